"""The invariants every node of a cluster must hold, each decided by one pure function that
`cluster up`'s preflight (preflight.py), `cluster up --head/--worker` and `llmctl doctor`
(doctor_checks.py) all call. Each caller words the verdict for its reader: a problem that stops
`up` before anything starts, or a row of the doctor's table with its fix.

    own_address("10.0.0.2", addresses of n2)   -> Address(eth0, 10.0.0.2/24), or None
    model_copies(["aaaa", "bbbb", None], head=0)    # n1 (the head), n2, n3
        -> [ModelCopy("reference", ...), ModelCopy("differs", ...), ModelCopy("missing", ...)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llmctl.cluster.launch.parsers import Address, interface_of


def own_address(ip: str, addresses: Sequence[Address]) -> Address | None:
    """IP ownership: a node's VLLM_HOST_IP is one of its own addresses. The address (with its
    interface, whose name NCCL_SOCKET_IFNAME gets), or None when the node does not hold `ip`:
    Ray would register the node under another address and NCCL could not bind to it."""
    return interface_of(list(addresses), ip)


CopyStatus = Literal["reference", "same", "differs", "missing", "unknown"]


@dataclass(frozen=True)
class ModelCopy:
    """One node's copy of the model against the reference copy."""

    status: CopyStatus  # unknown: there is no reference copy to compare with
    fingerprint: str | None  # None: the model path is missing on the node
    expected: str | None  # the reference copy's fingerprint
    reference: int | None  # the position of the node holding the reference copy


def model_copies(
    fingerprints: Sequence[str | None], head: int = 0, *, fallback: bool = True
) -> list[ModelCopy]:
    """Model identity: every node's copy of the model equals the reference copy (same files,
    same sizes, same config). `fingerprints` holds one per node (None: missing there). The
    reference is the head's copy; when the head has none and `fallback`, the first node's that
    has one. One ModelCopy per node, in the same order."""
    reference = head if fingerprints[head] is not None else None
    if reference is None and fallback:
        reference = next((i for i, fp in enumerate(fingerprints) if fp is not None), None)
    expected = fingerprints[reference] if reference is not None else None
    copies = []
    for i, mine in enumerate(fingerprints):
        if mine is None:
            status: CopyStatus = "missing"
        elif i == reference:
            status = "reference"
        elif expected is None:
            status = "unknown"
        else:
            status = "same" if mine == expected else "differs"
        copies.append(ModelCopy(status, mine, expected, reference))
    return copies


def differing_files(reference: Mapping[str, int], mine: Mapping[str, int]) -> list[str]:
    """The files whose presence or size differs between two copies of a model, sorted."""
    return sorted(n for n in set(reference) | set(mine) if reference.get(n) != mine.get(n))
