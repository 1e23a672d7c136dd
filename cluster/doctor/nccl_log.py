"""NCCL's debug log, read back: the transport NCCL chose between which ranks, and what it means.

With NCCL_DEBUG=INFO (or TRACE) NCCL logs one line per channel, e.g.
'Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA'. NET/IB/GDRDMA is what cross-node tensor
parallel wants; NET/Socket across nodes means the container cannot see the InfiniBand devices
(`assess_transport`). Pure: log text in, transport names and a verdict out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_CHANNEL = re.compile(
    r"Channel (\d+)(?:/\d+)? : (\d+)\[[^\]]*\] -> (\d+)\[[^\]]*\](?: \[(?:send|receive)\])? "
    r"via (.+?)\s*$",
    re.MULTILINE,
)
_USING_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")


@dataclass(frozen=True)
class NcclChannel:
    channel: int
    src: int
    dst: int
    transport: str


def normalize_transport(raw: str) -> str:
    """'NET/IB/0/GDRDMA' -> 'NET/IB/GDRDMA', 'NET/Socket/1' -> 'NET/Socket', 'NET/IBext_v8/2' ->
    'NET/IB', 'P2P/IPC/read' -> 'P2P/IPC', 'P2P/direct pointer' -> 'P2P/direct',
    'SHM/direct/direct' -> 'SHM'."""
    parts = raw.split("/")
    kind = parts[0]
    if kind == "NET" and len(parts) > 1:
        name = "IB" if parts[1].startswith("IB") else parts[1]
        return f"NET/{name}" + ("/GDRDMA" if "/GDRDMA" in raw else "")
    if kind == "P2P" and len(parts) > 1:
        return f"P2P/{parts[1].split()[0]}"
    return kind


def parse_nccl_channels(log_text: str) -> list[NcclChannel]:
    """Every 'Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA' line of an NCCL log."""
    return [
        NcclChannel(
            int(m.group(1)), int(m.group(2)), int(m.group(3)), normalize_transport(m.group(4))
        )
        for m in _CHANNEL.finditer(log_text)
    ]


def _weakness(transport: str) -> int:
    """Lower is weaker: sockets, other networks, InfiniBand, GPUDirect RDMA, then SHM and P2P
    inside a node."""
    if transport.startswith("NET/Socket"):
        return 0
    if transport.startswith("NET/"):
        return 3 if transport.endswith("/GDRDMA") else 2 if transport == "NET/IB" else 1
    return 4 if transport.startswith("SHM") else 5


def weakest(transports: Iterable[str | None]) -> str | None:
    """The transport that limits a collective: any network one before any intra-node one."""
    found = [t for t in transports if t]
    return min(found, key=_weakness) if found else None


def parse_nccl_transport(log_text: str) -> str | None:
    """The transport NCCL chose, from its INFO/TRACE log: the weakest of its channels
    ('NET/IB/GDRDMA', 'NET/IB', 'NET/Socket', 'P2P/IPC', 'P2P/CUMEM', 'SHM', ...); without
    channel lines, the network of 'Using network IB|Socket'; None when the log says neither."""
    channels = parse_nccl_channels(log_text)
    if channels:
        return weakest(c.transport for c in channels)
    match = _USING_NETWORK.search(log_text)
    return normalize_transport(f"NET/{match.group(1)}") if match else None


def assess_transport(transport: str | None, cross_node: bool) -> tuple[str, str, str | None]:
    """(status, detail, fix) of the transport NCCL chose."""
    if transport is None:
        return "pass", "no NCCL transport (Gloo uses TCP)", None
    if transport.startswith("NET/Socket"):
        if not cross_node:
            return "pass", f"{transport} (one node)", None
        return (
            "warn",
            f"NCCL uses {transport} between nodes: TCP sockets, too slow for cross-node "
            "tensor parallel",
            "give the containers the InfiniBand devices (--privileged, or --device "
            "/dev/infiniband --cap-add IPC_LOCK) and set NCCL_IB_HCA to the HCAs (ibv_devices "
            "lists them, e.g. NCCL_IB_HCA=mlx5); or use pipeline parallel across nodes",
        )
    if transport == "NET/IB":
        return (
            "pass",
            f"{transport}: InfiniBand/RoCE without GPUDirect RDMA (load nvidia_peermem for it)",
            None,
        )
    return "pass", transport, None
