"""Pure parsers of what nodes print: `ip -o addr`, `docker info`/`inspect`, `ray status`,
`ray list nodes --format json`, and the model listing behind a fingerprint.

Each takes text and returns a small dataclass; tests feed them captured output.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Address:
    ifname: str
    interface: ipaddress.IPv4Interface | ipaddress.IPv6Interface

    @property
    def ip(self) -> str:
        return str(self.interface.ip)


def parse_ip_addr(text: str) -> list[Address]:
    """`ip -o addr show`: '4: eth0    inet 10.0.0.2/24 brd ... scope global eth0\\ ...'."""
    addresses = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[2] not in ("inet", "inet6"):
            continue
        ifname = parts[1].split("@")[0]  # veth names print as eth0@if12
        addresses.append(Address(ifname, ipaddress.ip_interface(parts[3])))
    return addresses


def interface_of(addresses: list[Address], ip: str) -> Address | None:
    wanted = ipaddress.ip_address(ip)
    return next((a for a in addresses if a.interface.ip == wanted), None)


@dataclass(frozen=True)
class DockerInfo:
    server_version: str
    runtimes: tuple[str, ...]

    @property
    def nvidia(self) -> bool:
        return "nvidia" in self.runtimes


def parse_docker_info(text: str) -> DockerInfo:
    """`docker info --format '{{.ServerVersion}} {{json .Runtimes}}'`."""
    version, _, runtimes = text.strip().partition(" ")
    try:
        names = tuple(sorted(json.loads(runtimes or "{}")))
    except json.JSONDecodeError:
        names = ()
    return DockerInfo(version, names)


@dataclass(frozen=True)
class ContainerState:
    name: str
    status: str  # created, running, exited, ...
    running: bool
    exit_code: int
    image_id: str
    labels: dict[str, str] = field(default_factory=dict)


def parse_docker_inspect(text: str) -> ContainerState | None:
    """`docker container inspect NAME` (a JSON list); None when the list is empty."""
    items = json.loads(text or "[]")
    if not items:
        return None
    item = items[0]
    state = item.get("State", {})
    return ContainerState(
        name=item.get("Name", "").lstrip("/"),
        status=state.get("Status", "unknown"),
        running=bool(state.get("Running")),
        exit_code=int(state.get("ExitCode", 0)),
        image_id=item.get("Image", ""),
        labels=dict((item.get("Config") or {}).get("Labels") or {}),
    )


@dataclass(frozen=True)
class RayStatus:
    active_nodes: tuple[str, ...]
    pending_nodes: tuple[str, ...]
    totals: dict[str, float]  # resource -> total, e.g. {"CPU": 6.0, "GPU": 4.0}

    @property
    def gpus(self) -> float:
        return self.totals.get("GPU", 0.0)


_USAGE = re.compile(r"^\s*([\d.]+)(\w*)/([\d.]+)(\w*)\s+(\S+)\s*$")


def parse_ray_status(text: str) -> RayStatus:
    """The 'Node status' and 'Total Usage' sections of `ray status`."""
    section = None
    active: list[str] = []
    pending: list[str] = []
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line in ("Active:", "Pending:", "Recent failures:", "Total Usage:"):
            section = line
            continue
        if not line or line.startswith("-") or line.startswith("="):
            continue
        if line.endswith(":"):
            section = None
            continue
        if section == "Active:" and not line.startswith("("):
            active.append(line.split()[-1])
        elif section == "Pending:" and not line.startswith("("):
            pending.append(line)
        elif section == "Total Usage:":
            match = _USAGE.match(line)
            if match and not match.group(4):  # plain counts (CPU, GPU); not memory with units
                totals[match.group(5)] = float(match.group(3))
    return RayStatus(tuple(active), tuple(pending), totals)


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    is_head: bool
    alive: bool
    gpus: float


def parse_ray_nodes(text: str) -> list[RayNode]:
    """`ray list nodes --format json`."""
    nodes = []
    for item in json.loads(text):
        resources = item.get("resources_total") or {}
        nodes.append(
            RayNode(
                node_id=item.get("node_id", ""),
                ip=item.get("node_ip", ""),
                is_head=bool(item.get("is_head_node")),
                alive=item.get("state") == "ALIVE",
                gpus=float(resources.get("GPU", 0.0)),
            )
        )
    return nodes


# Files whose content the fingerprint hashes; every other file enters by name and size.
FINGERPRINT_CONTENT = ("config.json", "generation_config.json")


def parse_listing(text: str) -> dict[str, int]:
    """`find MODEL -maxdepth 1 -type f -printf '%f\\t%s\\n'` -> {file name: size}."""
    files = {}
    for line in text.splitlines():
        name, _, size = line.rpartition("\t")
        if name:
            files[name] = int(size)
    return files


def hashed_files(files: dict[str, int]) -> list[str]:
    """Which files of a listing the fingerprint hashes: config and weight indexes."""
    return sorted(n for n in files if n in FINGERPRINT_CONTENT or n.endswith(".index.json"))


def parse_sha256sum(text: str) -> dict[str, str]:
    """`sha256sum PATH...` -> {file name: digest}."""
    digests = {}
    for line in text.splitlines():
        digest, _, path = line.partition("  ")
        if path:
            digests[path.rsplit("/", 1)[-1]] = digest
    return digests


def model_fingerprint(files: dict[str, int], digests: dict[str, str]) -> str:
    """A short digest of a model: every file's name and size, plus config and index content."""
    blob = json.dumps({"files": sorted(files.items()), "content": sorted(digests.items())})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


_GPU_ROW = re.compile(r"^GPU\d+\s")
_NVLINK_CELL = re.compile(r"^NV\d+$")


def parse_nvidia_topo(text: str) -> bool | None:
    """`nvidia-smi topo -m`: True when some GPU pair is joined by NVLink (an `NV#` cell), False
    when there are 2 or more GPUs and none is, None with fewer than 2 GPUs.

        \\tGPU0\\tGPU1\\tCPU Affinity\\tNUMA Affinity
        GPU0\\t X \\tNV12\\t0-23\\t0
        GPU1\\tNV12\\t X \\t0-23\\t0
    """
    rows = [line.split() for line in text.splitlines() if _GPU_ROW.match(line)]
    if len(rows) < 2:
        return None
    cells = (cell for row in rows for cell in row[1 : len(rows) + 1])
    return any(_NVLINK_CELL.match(cell) for cell in cells)
