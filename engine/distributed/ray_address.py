"""The Ray cluster this machine means: RAY_ADDRESS, else the one `ray start` last recorded here.

`ray start` writes its GCS address to `ray_current_cluster` in Ray's temp directory (RAY_TMPDIR,
else TMPDIR, else /tmp, plus `ray/`), and `ray stop` removes it; `ray.init(address=None)` joins
that cluster, and so do we. We never use Ray's legacy `address="auto"` fallback, which joins any
raylet it sees in the process table: on a host that runs Ray in containers (a `llmctl cluster up`
node, a CI machine) or for another user, that is someone else's cluster, reached across a network
namespace, with a token we do not hold.

An address is probed before Ray is given it: Ray waits minutes on a GCS that is not there (a
`ray start` killed without `ray stop` leaves its address behind), and then exits the process.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from llmctl.engine.errors import ConfigError

_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RayAddress:
    address: str
    source: str  # "RAY_ADDRESS" or the ray_current_cluster file's path


def ray_temp_dir() -> str:
    """Where Ray keeps its sessions and `ray_current_cluster` (as Ray chooses it)."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(base, "ray")


def find_ray_address() -> RayAddress | None:
    """RAY_ADDRESS when set and not empty, else the address the last `ray start` on this machine
    recorded, else None (start a private Ray)."""
    named = os.environ.get("RAY_ADDRESS", "").strip()
    if named:
        return RayAddress(named, "RAY_ADDRESS")
    path = os.path.join(ray_temp_dir(), "ray_current_cluster")
    try:
        with open(path) as f:
            recorded = f.read().strip()
    except OSError:
        return None
    return RayAddress(recorded, path) if recorded else None


def check_reachable(found: RayAddress) -> None:
    """A ConfigError at once when `found` is host:port and nothing listens there. Other forms
    (`ray://`, `auto`, `local`) are Ray's to interpret."""
    host, sep, port = found.address.rpartition(":")
    if not sep or "/" in found.address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        if found.source == "RAY_ADDRESS":
            where = "RAY_ADDRESS names"
            hint = (
                "start the head (`ray start --head`, or `llmctl cluster up --head`), "
                "or unset RAY_ADDRESS"
            )
        else:
            where = f"`ray start` recorded in {found.source}"
            hint = (
                "that cluster is gone: start it again (`ray start --head`), or remove the file "
                "(`ray stop` does) to let llmctl start a private Ray"
            )
        raise ConfigError(
            f"no Ray cluster answers at {found.address}, the address {where} ({exc})", hint
        ) from None
