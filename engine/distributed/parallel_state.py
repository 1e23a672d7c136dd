"""Process groups: which ranks form this rank's tensor-parallel and pipeline-parallel groups.

A single process (the uni executor) has one-rank groups and never touches torch.distributed.
With several ranks, `init_distributed_environment` joins the world (Gloo on the CPU, NCCL on CUDA)
and `initialize_model_parallel` builds the groups from the one rank mesh in `ranks.reshape`.
Layers ask `get_tp_group()` for tp_rank/tp_size, never the world size, so TP and PP compose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupCoordinator:
    """One process group and this rank's place in it, with the collectives layers use."""

    ranks: list[int]
    rank: int  # global rank of this process
    device_group: Any = field(default=None, repr=False)  # torch ProcessGroup for tensors
    cpu_group: Any = field(default=None, repr=False)  # Gloo group for Python objects

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor):
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor, dim: int = -1):
        """Concatenate each rank's `tensor` along `dim` (shapes may differ along `dim`)."""
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        sizes = self.all_gather_object(tensor.shape[dim])
        pieces = []
        for size in sizes:
            shape = list(tensor.shape)
            shape[dim] = size
            pieces.append(torch.empty(shape, dtype=tensor.dtype, device=tensor.device))
        if all(size == tensor.shape[dim] for size in sizes):
            dist.all_gather(pieces, tensor.contiguous(), group=self.device_group)
        else:
            # Uneven shards: pad to the largest, gather, then trim.
            largest = max(sizes)
            pad_shape = list(tensor.shape)
            pad_shape[dim] = largest
            padded = torch.zeros(pad_shape, dtype=tensor.dtype, device=tensor.device)
            padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
            gathered = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(gathered, padded, group=self.device_group)
            pieces = [g.narrow(dim, 0, s) for g, s in zip(gathered, sizes, strict=True)]
        return torch.cat(pieces, dim=dim)

    def all_gather_object(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def send(self, tensor, dst_in_group: int) -> None:
        import torch.distributed as dist

        dist.send(tensor, self.ranks[dst_in_group], group=self.device_group)

    def recv(self, tensor, src_in_group: int):
        import torch.distributed as dist

        dist.recv(tensor, self.ranks[src_in_group], group=self.device_group)
        return tensor


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def get_tp_group() -> GroupCoordinator:
    global _TP
    if _TP is None:
        _TP = GroupCoordinator(ranks=[0], rank=0)
    return _TP


def get_pp_group() -> GroupCoordinator:
    global _PP
    if _PP is None:
        _PP = GroupCoordinator(ranks=[0], rank=0)
    return _PP


def set_groups(tp: GroupCoordinator, pp: GroupCoordinator) -> None:
    global _TP, _PP
    _TP, _PP = tp, pp


def reset_groups() -> None:
    global _TP, _PP
    _TP = _PP = None
