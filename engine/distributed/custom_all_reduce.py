"""CustomAllReduce: small tensor-parallel all-reduces between GPUs of one node, through their
peer-to-peer mapped memory instead of NCCL.

A decode step of a tensor-parallel model all-reduces a few [batch, hidden] activations per layer:
kilobytes, where NCCL's ring costs tens of microseconds of latency each (vLLM's custom
all-reduce exists for the same reason). Here each rank copies its tensor into a buffer of
symmetric memory (torch.distributed._symmetric_memory: the same allocation mapped on every GPU
of the group) and torch's one-shot all-reduce sums the peers' buffers in one kernel: one copy and
one kernel, both captured by CUDA graphs.

It is used only where it can work, decided once when the group is made (`choose`):
- CUDA tensors and more than one rank, every rank on this node;
- every GPU of the group can map every other's memory (torch.cuda.can_device_access_peer);
- this torch has symmetric memory and its one-shot all-reduce, and an all-reduce of a known
  tensor through it gives the right sums (a check at set-up; otherwise a warning and NCCL);
- LLMCTL_CUSTOM_ALL_REDUCE is not 0.
and per call for tensors of at most MAX_BYTES (8 MiB); larger ones, and everything elsewhere,
go to NCCL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("llmctl")

MAX_BYTES = 8 << 20


def choose(
    device_type: str,
    hostnames: Sequence[str],
    devices: Sequence[int],
    peer_access: Callable[[int, int], bool],
    enabled: bool,
    capable: Sequence[bool] = (),
) -> str | None:
    """Why the group cannot use the custom all-reduce (None: it can), from its ranks' hosts,
    CUDA devices and torch builds (`capable`: it has symmetric memory), and the peer-access
    relation between devices."""
    if not enabled:
        return "LLMCTL_CUSTOM_ALL_REDUCE=0"
    if device_type != "cuda":
        return "not on CUDA"
    if len(hostnames) < 2:
        return "one rank"
    if len(set(hostnames)) > 1:
        return "the ranks span nodes"
    if not all(capable):
        return "this torch has no symmetric memory (torch.distributed._symmetric_memory)"
    if len(set(devices)) < len(devices):
        return "the ranks see their GPUs under one index (each its own only): peer access unknown"
    for a in devices:
        for b in devices:
            if a != b and not peer_access(a, b):
                return f"GPU {a} cannot map GPU {b}'s memory (no peer access)"
    return None


class CustomAllReduce:
    def __init__(self, group: Any, rank_in_group: int, device: Any) -> None:
        """`group`: the NCCL process group of the tensor-parallel ranks (its name keys the
        symmetric memory). Raises where symmetric memory is missing or wrong (the caller falls
        back to NCCL)."""
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # torch < 2.9 asks for it first
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce
        self._check(rank_in_group, group.size(), device)

    def fits(self, tensor: Any) -> bool:
        return tensor.is_cuda and tensor.numel() * tensor.element_size() <= MAX_BYTES

    def all_reduce(self, tensor: Any) -> Any:
        """The sum over the group's ranks of `tensor` (a new tensor, `tensor`'s shape)."""
        n = tensor.numel() * tensor.element_size()
        staged = self.buffer[:n].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        return self.op(staged, "sum", self.group_name)

    def _check(self, rank: int, world: int, device: Any) -> None:
        import torch

        mine = torch.full((4, 256), float(rank + 1), dtype=torch.float32, device=device)
        total = self.all_reduce(mine)
        torch.cuda.synchronize(device)
        expected = world * (world + 1) / 2
        if not torch.all(total == expected).item():
            raise RuntimeError(f"a check all-reduce gave {total.flatten()[0].item()}")


def symmetric_memory_available() -> bool:
    try:
        import torch
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    ops = getattr(torch.ops, "symm_mem", None)
    return all(hasattr(symm_mem, f) for f in ("empty", "rendezvous")) and hasattr(
        ops, "one_shot_all_reduce"
    )


def attach(group: Any, enabled: bool) -> None:
    """Give a CUDA GroupCoordinator whose ranks share a node with peer access its custom
    all-reduce (group.custom); else leave NCCL, saying why in the debug log. Every rank takes
    the same decision from the same gathered facts before any collective set-up starts."""
    import socket

    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    facts = group.all_gather_object(
        (socket.gethostname(), device.index, symmetric_memory_available())
    )
    why = choose(
        "cuda",
        [host for host, _, _ in facts],
        [index for _, index, _ in facts],
        torch.cuda.can_device_access_peer,
        enabled,
        [capable for _, _, capable in facts],
    )
    if why is None:
        try:
            group.custom = CustomAllReduce(group.device_group, group.rank_in_group, device)
        except Exception as exc:  # noqa: BLE001 - any failure: NCCL, as before
            why = f"symmetric memory failed: {type(exc).__name__}: {exc}"
            group.custom = None
    # every rank decides alike (the same facts), but a failed set-up must not leave one rank on
    # a different path: all use it only if all set it up
    if not all(group.all_gather_object(group.custom is not None)):
        group.custom, why = None, why or "another rank could not set it up"
    if why is None:
        logger.info("Tensor-parallel all-reduces up to %d MiB: peer-to-peer", MAX_BYTES >> 20)
    else:
        logger.debug("Tensor-parallel all-reduces through NCCL: %s", why)
