"""NodeReport: what one node says about itself, for `llmctl doctor` to compare across nodes.

`collect_local_report()` gathers it on the machine it runs on (directly, or inside a Ray actor
pinned to a node): the node's facts through probe.probe_node over a LocalTransport, the same
commands and parsers `cluster up` runs on a node over SSH (addresses, the model's fingerprint,
/dev/shm, the GPUs), plus this process's environment and package versions. No torch import:
collecting takes milliseconds. Secrets never leave the node: variables whose names mark them as
secrets keep their name and a mask, never the value.

A NodeReport round-trips through JSON (`to_json` / `from_json`), so reports cross processes and
Ray.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import ipaddress
import os
import platform
import socket
from dataclasses import dataclass, field
from typing import Any

from llmctl.cluster.launch.node_launch import is_secret
from llmctl.cluster.launch.parsers import Address, parse_nvidia_topo
from llmctl.cluster.launch.probe import (
    NodeProbe,
    fingerprint,
    parse_if_inet6,
    probe_node,
    read_addresses,
)
from llmctl.cluster.launch.transport import LocalTransport, Transport

__all__ = [
    "NodeReport",
    "collect_local_report",
    "distinct_names",
    "local_addresses",
    "local_model_fingerprint",
    "parse_if_inet6",
    "parse_nvidia_topo",
    "relevant_env",
]

# The variables that decide how ranks find and talk to each other.
ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "RAY_", "TORCH_NCCL_")
SECRET_MASK = "***"  # a secret's value, as a report holds it: set, but not shown
VERSION_PACKAGES = ("torch", "ray", "llmctl")


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


def collect_local_report(
    model: str | None = None, *, ray_ip: str | None = None, transport: Transport | None = None
) -> NodeReport:
    """This machine's NodeReport. `ray_ip` is Ray's node IP when run inside a Ray actor."""
    transport = transport or LocalTransport(socket.gethostname())
    probe = probe_node(transport, None, model, None, docker=False, devices=True)
    if probe.error is not None:
        raise probe.error
    return report_of(probe, dict(os.environ), model=model, ray_ip=ray_ip)


def report_of(
    probe: NodeProbe, environ: dict[str, str], *, model: str | None, ray_ip: str | None = None
) -> NodeReport:
    """A probe (devices=True) and a process's environment, as the doctor's NodeReport."""
    return NodeReport(
        node=probe.hostname or probe.host,
        host_ip=environ.get("VLLM_HOST_IP") or None,
        ray_ip=ray_ip,
        addresses=tuple(probe.addresses),
        env=relevant_env(environ),
        shm_bytes=probe.shm_bytes,
        versions=local_versions(),
        model=model,
        model_fingerprint=probe.model_fingerprint,
        gpus=probe.gpus,
        nvlink=probe.nvlink,
    )


def local_addresses() -> list[Address]:
    """This machine's addresses (probe.read_addresses over a LocalTransport)."""
    return read_addresses(LocalTransport())


def local_model_fingerprint(model: str) -> str | None:
    """The fingerprint `cluster up` computes over SSH (probe.fingerprint), on this machine: the
    files of `find -L MODEL -maxdepth 1 -type f` (a Hugging Face snapshot is a folder of links;
    a .gguf lists itself); None when the path is missing or holds no file."""
    return fingerprint(LocalTransport(), model)[1]


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
