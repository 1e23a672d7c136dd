"""Preflight: pure checks of the inventory and of what the probes found, before anything starts.

Every problem on every node is collected, so one run of `cluster up` names them all. A cluster is
started only when the list is empty.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from llmctl.cluster.errors import (
    ClusterError,
    DockerUnavailableError,
    ImageMissingError,
    ModelMismatchError,
    NodeNetworkError,
)
from llmctl.cluster.inventory import Inventory, NodeSpec
from llmctl.cluster.launch.invariants import differing_files, model_copies, own_address
from llmctl.cluster.launch.probe import NodeProbe, docker_problem


@dataclass(frozen=True)
class Problem:
    host: str
    kind: type[ClusterError]
    message: str
    hint: str

    def error(self) -> ClusterError:
        return self.kind(self.message, self.hint)


def public_ip_problems(inventory: Inventory, allow_public_ip: bool) -> list[Problem]:
    """The seeds: Ray's traffic is unencrypted; a public VLLM_HOST_IP exposes the cluster."""
    if allow_public_ip:
        return []
    return [
        Problem(
            node.host,
            NodeNetworkError,
            f"{node.host}: VLLM_HOST_IP {node.ip} is a public address; Ray and NCCL traffic is"
            " unencrypted and a reachable Ray port lets anyone run code on the cluster",
            "use the nodes' private network addresses as `ip:`, or pass --allow-public-ip",
        )
        for node in inventory.nodes
        if ipaddress.ip_address(node.ip).is_global
    ]


def probe_problems(
    inventory: Inventory,
    probes: dict[str, NodeProbe],
    *,
    image: str | None,
    image_file: str | None,
    sync_model: bool,
) -> list[Problem]:
    problems: list[Problem] = []
    head = inventory.head
    head_probe = probes[head.host]
    for node in inventory.nodes:
        probe = probes[node.host]
        if probe.error is not None:
            problems.append(
                Problem(node.host, type(probe.error), probe.error.message, probe.error.hint or "")
            )
            continue
        problems += _network_problems(node, probe, head, head_probe)
        if probe.docker is None:
            cause = docker_problem(probe.docker_error) if probe.docker_error else "no Docker"
            problems.append(
                Problem(
                    node.host,
                    DockerUnavailableError,
                    f"{node.host}: {cause}",
                    "install docker (apt-get install docker.io), start its daemon, and let"
                    " the SSH user use it",
                )
            )
        elif image and probe.image_id is None and not image_file:
            problems.append(
                Problem(
                    node.host,
                    ImageMissingError,
                    f"{node.host}: the image {image} is not there",
                    f"pull or build it on the node, or pass --image-file FILE (made with"
                    f" `docker save {image} -o FILE`) to load it on the nodes that lack it",
                )
            )
    problems += _model_problems(inventory, probes, sync_model)
    return problems


def _network_problems(
    node: NodeSpec, probe: NodeProbe, head: NodeSpec, head_probe: NodeProbe
) -> list[Problem]:
    if own_address(node.ip, probe.addresses) is None:
        have = ", ".join(
            f"{a.ip} ({a.ifname})" for a in probe.addresses if not a.interface.is_loopback
        )
        return [
            Problem(
                node.host,
                NodeNetworkError,
                f"{node.host}: {node.ip} is not an address of this node (it has {have or 'none'})",
                "set the node's `ip:` (its VLLM_HOST_IP) to one of its own addresses",
            )
        ]
    if node.head or head_probe.error is not None:
        return []
    head_address = own_address(head.ip, head_probe.addresses)
    if head_address is None:
        return []  # reported on the head
    if ipaddress.ip_address(node.ip) not in head_address.interface.network:
        return [
            Problem(
                node.host,
                NodeNetworkError,
                f"{node.host}: its IP {node.ip} is not on the head's network"
                f" {head_address.interface.network} ({head_address.ifname} on {head.host});"
                " Ray and NCCL on the head could not reach it",
                f"give {node.host} its address on {head_address.interface.network} as `ip:`",
            )
        ]
    return []


def _model_problems(
    inventory: Inventory, probes: dict[str, NodeProbe], sync_model: bool
) -> list[Problem]:
    if not inventory.model:
        return []
    reachable = [n for n in inventory.nodes if probes[n.host].error is None]
    if not reachable:
        return []
    head = next((i for i, n in enumerate(reachable) if n.head), 0)
    copies = model_copies([probes[n.host].model_fingerprint for n in reachable], head)
    if all(copy.status == "missing" for copy in copies):
        return [
            Problem(
                inventory.head.host,
                ModelMismatchError,
                f"the model {inventory.model} is on none of the nodes",
                "copy it to that path on one node (the head), then pass --sync-model",
            )
        ]
    reference = reachable[copies[0].reference or 0]
    problems = []
    for node, copy in zip(reachable, copies, strict=True):
        if copy.status == "missing" and not sync_model:
            problems.append(
                Problem(
                    node.host,
                    ModelMismatchError,
                    f"{node.host}: the model {inventory.model} is missing",
                    f"copy it there, or pass --sync-model to copy it from {reference.host}",
                )
            )
        elif copy.status == "differs":
            differ = differing_files(
                probes[reference.host].model_files or {}, probes[node.host].model_files or {}
            )
            detail = f"files differ: {', '.join(differ[:4])}" if differ else "config differs"
            problems.append(
                Problem(
                    node.host,
                    ModelMismatchError,
                    f"{node.host}: the model {inventory.model} differs from {reference.host}'s"
                    f" (fingerprint {copy.fingerprint} vs {copy.expected}; {detail})",
                    "make the model identical on every node (--sync-model only fills missing"
                    " copies; it never overwrites one)",
                )
            )
    return problems


def raise_problems(problems: list[Problem]) -> None:
    """Raise the first problem's error class, its message listing every problem found."""
    if not problems:
        return
    first = problems[0]
    if len(problems) == 1:
        raise first.kind(f"{first.message} (nothing was started)", first.hint)
    lines = "\n".join(f"  - {p.message}" for p in problems)
    hints = "; ".join(dict.fromkeys(p.hint for p in problems if p.hint))
    raise first.kind(f"{len(problems)} problems, nothing was started:\n{lines}", hints)
