"""NodeReport: what one node says about itself, for `llmctl doctor` to compare across nodes.

`collect_local_report()` gathers it on the machine it runs on (directly, or inside a Ray actor
pinned to a node) with plain Python: the environment, `ip -o addr` (or the kernel's interface
tables when `ip` is missing), the size of /dev/shm, package versions, the model's fingerprint and
the GPUs. No torch import: collecting takes milliseconds. Secrets never leave the node: variables
whose names mark them as secrets keep their name and a mask, never the value.

Everything else here is pure: `parse_nvidia_topo` reads `nvidia-smi topo -m`, and a NodeReport
round-trips through JSON (`to_json` / `from_json`), so reports cross processes and Ray.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import ipaddress
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.cluster.node_launch import is_secret
from llmctl.cluster.parsers import (
    Address,
    hashed_files,
    model_fingerprint,
    parse_ip_addr,
)

# The variables that decide how ranks find and talk to each other.
ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "RAY_", "TORCH_NCCL_")
SECRET_MASK = "***"  # a secret's value, as a report holds it: set, but not shown
VERSION_PACKAGES = ("torch", "ray", "llmctl")
_COMMAND_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NodeReport:
    node: str  # the hostname (made unique across a cluster by `distinct_names`)
    host_ip: str | None  # VLLM_HOST_IP
    ray_ip: str | None = None  # Ray's node IP, when collected inside a Ray actor
    addresses: tuple[Address, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # ENV_PREFIXES variables, secrets masked
    shm_bytes: int | None = None  # size of /dev/shm; None when it is missing
    versions: dict[str, str | None] = field(default_factory=dict)  # python, torch, ray, llmctl
    model: str | None = None
    model_fingerprint: str | None = None  # None: the model path is missing on this node
    gpus: int | None = None  # None: unknown
    nvlink: bool | None = None  # None: unknown, or fewer than 2 GPUs

    @property
    def ip(self) -> str | None:
        """The address the node is known by: VLLM_HOST_IP, else Ray's node IP."""
        return self.host_ip or self.ray_ip

    def interface_names(self) -> list[str]:
        return list(dict.fromkeys(a.ifname for a in self.addresses))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["addresses"] = [
            {"ifname": a.ifname, "address": str(a.interface)} for a in self.addresses
        ]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeReport:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["addresses"] = tuple(
            Address(a["ifname"], ipaddress.ip_interface(a["address"]))
            for a in data.get("addresses", ())
        )
        return cls(**values)


def collect_local_report(model: str | None = None, *, ray_ip: str | None = None) -> NodeReport:
    """This machine's NodeReport. `ray_ip` is Ray's node IP when run inside a Ray actor."""
    environ = dict(os.environ)
    gpus = _gpu_count()
    return NodeReport(
        node=socket.gethostname(),
        host_ip=environ.get("VLLM_HOST_IP") or None,
        ray_ip=ray_ip,
        addresses=tuple(local_addresses()),
        env=relevant_env(environ),
        shm_bytes=shm_size("/dev/shm"),
        versions=local_versions(),
        model=model,
        model_fingerprint=local_model_fingerprint(model) if model else None,
        gpus=gpus,
        nvlink=_nvlink() if gpus and gpus > 1 else None,
    )


def relevant_env(environ: dict[str, str]) -> dict[str, str]:
    """The ENV_PREFIXES variables of `environ`, sorted, with secret values masked."""
    return {
        name: SECRET_MASK if is_secret(name) else value
        for name, value in sorted(environ.items())
        if name.startswith(ENV_PREFIXES)
    }


def local_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def shm_size(path: str = "/dev/shm") -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


# -- addresses -------------------------------------------------------------------------------


def local_addresses() -> list[Address]:
    """Every address of every interface: `ip -o addr show`, else the kernel's tables."""
    ip = shutil.which("ip")
    if ip:
        try:
            result = subprocess.run(
                [ip, "-o", "addr", "show"],
                capture_output=True,
                text=True,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
            )
            if result.returncode == 0:
                return parse_ip_addr(result.stdout)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return _ipv4_by_ioctl() + parse_if_inet6(_read("/proc/net/if_inet6"))


_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def _ipv4_by_ioctl() -> list[Address]:
    """Each interface's primary IPv4 address and netmask (SIOCGIFADDR, SIOCGIFNETMASK)."""
    addresses = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                addr = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24]
                mask = fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, request)[20:24]
            except OSError:  # no IPv4 address on this interface
                continue
            interface = ipaddress.IPv4Interface(
                f"{socket.inet_ntoa(addr)}/{socket.inet_ntoa(mask)}"
            )
            addresses.append(Address(name, interface))
    return addresses


def parse_if_inet6(text: str) -> list[Address]:
    """/proc/net/if_inet6: 'fe800000000000000000000000000001 02 40 20 80 eth0' per address
    (address in hex, interface index, prefix length in hex, scope, flags, name)."""
    addresses = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 6:
            continue
        raw, _, prefix, _, _, name = parts
        ip = ipaddress.IPv6Address(bytes.fromhex(raw))
        addresses.append(Address(name, ipaddress.IPv6Interface(f"{ip}/{int(prefix, 16)}")))
    return addresses


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# -- model -----------------------------------------------------------------------------------


def local_model_fingerprint(model: str) -> str | None:
    """The fingerprint `cluster up` computes over SSH (parsers.model_fingerprint), here.

    Same listing as `find -L MODEL -maxdepth 1 -type f`: files, symlinks followed (a Hugging
    Face cache snapshot is a folder of links); a single file (a .gguf) lists itself. None when
    the path is missing or holds no file.
    """
    path = Path(model)
    if path.is_file():
        candidates = [path]
    elif path.is_dir():
        candidates = [p for p in path.iterdir() if p.is_file()]
    else:
        return None
    files = {p.name: p.stat().st_size for p in candidates}
    if not files:
        return None
    directory = path if path.is_dir() else path.parent
    digests = {name: _sha256(directory / name) for name in hashed_files(files)}
    return model_fingerprint(files, digests)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- GPUs ------------------------------------------------------------------------------------


def _nvidia_smi(*args: str) -> str | None:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        result = subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _gpu_count() -> int | None:
    listing = _nvidia_smi("-L")
    if listing is not None:
        return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return None if Path("/dev/nvidiactl").exists() else 0


def _nvlink() -> bool | None:
    topology = _nvidia_smi("topo", "-m")
    return parse_nvidia_topo(topology) if topology is not None else None


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


def distinct_names(reports: list[NodeReport]) -> list[NodeReport]:
    """Reports whose hostnames repeat (containers or network namespaces of one machine) renamed
    `host@ip` (Ray's node IP, else VLLM_HOST_IP), and `host@ip#i` (i: the position) if that
    repeats too, so that every row of the doctor's table names one node."""

    def repeated(names: list[str]) -> set[str]:
        return {n for n in names if names.count(n) > 1}

    names = [r.node for r in reports]
    twice = repeated(names)
    # Ray's node IP first: the address the cluster knows the node by, even where VLLM_HOST_IP
    # is wrong (the very thing the doctor may be reporting).
    names = [
        f"{r.node}@{r.ray_ip or r.ip}" if r.node in twice and (r.ray_ip or r.ip) else r.node
        for r in reports
    ]
    twice = repeated(names)
    names = [f"{n}#{i}" if n in twice else n for i, n in enumerate(names)]
    return [dataclasses.replace(r, node=n) for r, n in zip(reports, names, strict=True)]
