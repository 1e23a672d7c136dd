"""Probe: the one collector of a node's facts, read-only, over its Transport (Docker, image,
addresses, model, the cluster's container, /dev/shm, GPUs). `cluster up` probes every node in
parallel (SSH) before it changes anything; the doctor probes the node it runs on (LocalTransport,
node_facts.collect_local_report), so both read a fact with the same command and parser.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.cluster.errors import ClusterError
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.parsers import (
    Address,
    ContainerState,
    DockerInfo,
    hashed_files,
    model_fingerprint,
    parse_docker_info,
    parse_docker_inspect,
    parse_ip_addr,
    parse_listing,
    parse_nvidia_topo,
    parse_sha256sum,
)
from llmctl.cluster.launch.transport import (
    COMMAND_NOT_FOUND,
    CommandResult,
    LocalTransport,
    Transport,
)

_DEVICE_TIMEOUT_S = 10.0  # nvidia-smi on a wedged driver may hang


@dataclass
class NodeProbe:
    host: str
    error: ClusterError | None = None  # could not connect at all
    docker: DockerInfo | None = None
    docker_error: CommandResult | None = None
    image_id: str | None = None
    addresses: list[Address] = field(default_factory=list)
    model_files: dict[str, int] | None = None  # None: the model path is missing
    model_fingerprint: str | None = None
    container: ContainerState | None = None
    home: str = "/root"
    hostname: str | None = None
    # With devices=True (the doctor):
    shm_bytes: int | None = None  # size of /dev/shm; None when it is missing
    gpus: int | None = None  # None: unknown
    nvlink: bool | None = None  # None: unknown, or fewer than 2 GPUs


def probe_node(
    transport: Transport,
    image: str | None,
    model: str | None,
    container: str | None,
    *,
    docker: bool = True,
    devices: bool = False,
) -> NodeProbe:
    """What the node has; `docker=False` skips Docker (inside a container), `devices=True`
    adds /dev/shm and the GPUs. A node that cannot be reached has `error` set."""
    probe = NodeProbe(transport.name)
    try:
        probe.home = transport.home()
        named = transport.run(["uname", "-n"])
        probe.hostname = (named.stdout.strip() or None) if named.ok else None
        if docker:
            info = transport.run(commands.docker_info_argv(), timeout=30)
            if info.ok:
                probe.docker = parse_docker_info(info.stdout)
            else:
                probe.docker_error = info
        probe.addresses = read_addresses(transport)
        if probe.docker is not None:
            if image:
                found = transport.run(commands.image_id_argv(image))
                probe.image_id = found.stdout.strip() if found.ok else None
            if container:
                probe.container = inspect_container(transport, container)
        if model:
            probe.model_files, probe.model_fingerprint = fingerprint(transport, model)
        if devices:
            probe.shm_bytes = shm_size(transport)
            probe.gpus = gpu_count(transport)
            probe.nvlink = nvlink(transport) if probe.gpus and probe.gpus > 1 else None
    except ClusterError as exc:
        probe.error = exc
    return probe


def read_addresses(transport: Transport) -> list[Address]:
    """Every address of every interface: `ip -o addr show`; on this machine without `ip` (a
    slim container), the kernel's tables instead."""
    result = transport.run(commands.ip_addr_argv())
    if result.ok or not isinstance(transport, LocalTransport):
        return parse_ip_addr(result.stdout)
    return _ipv4_by_ioctl() + parse_if_inet6(_read("/proc/net/if_inet6"))


def inspect_container(transport: Transport, container: str) -> ContainerState | None:
    result = transport.run(commands.docker_inspect_argv(container))
    return parse_docker_inspect(result.stdout) if result.ok else None


def fingerprint(transport: Transport, model: str) -> tuple[dict[str, int] | None, str | None]:
    listing = transport.run(commands.model_listing_argv(model))
    files = parse_listing(listing.stdout) if listing.ok else {}
    if not files:
        return None, None
    digests: dict[str, str] = {}
    names = hashed_files(files)
    if names:
        result = transport.run(commands.sha256_argv([f"{model.rstrip('/')}/{n}" for n in names]))
        digests = parse_sha256sum(result.stdout)
    return files, model_fingerprint(files, digests)


def docker_problem(result: CommandResult) -> str:
    """Why `docker info` failed, in a user's words."""
    if result.returncode == COMMAND_NOT_FOUND or "command not found" in result.stderr:
        return "Docker is not installed"
    return f"the Docker daemon does not answer ({result.error_line()})"


def shm_size(transport: Transport, path: str = "/dev/shm") -> int | None:
    """The size of the filesystem at `path` (statvfs: fragment size x blocks); None if missing."""
    result = transport.run(commands.statfs_argv(path))
    try:
        frsize, blocks = (int(n) for n in result.stdout.split())
    except ValueError:
        return None
    return frsize * blocks if result.ok else None


def _nvidia_smi(transport: Transport, *args: str) -> str | None:
    try:
        result = transport.run(["nvidia-smi", *args], timeout=_DEVICE_TIMEOUT_S)
    except ClusterError:  # timed out
        return None
    return result.stdout if result.ok else None


def gpu_count(transport: Transport) -> int | None:
    """`nvidia-smi -L`'s GPUs; without it, 0, or None (unknown) where the driver's device is."""
    listing = _nvidia_smi(transport, "-L")
    if listing is not None:
        return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return None if transport.run(["test", "-e", "/dev/nvidiactl"]).ok else 0


def nvlink(transport: Transport) -> bool | None:
    topology = _nvidia_smi(transport, "topo", "-m")
    return parse_nvidia_topo(topology) if topology is not None else None


# -- this machine without `ip` ------------------------------------------------------------------
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
