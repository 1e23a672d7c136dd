"""Process groups: which ranks form this rank's tensor-parallel and pipeline-parallel groups.

A single process (the uni executor) has one-rank groups and never touches torch.distributed.
With several ranks, `init_distributed_environment` joins the world (Gloo on the CPU, NCCL on CUDA)
and `initialize_model_parallel` builds the groups from the one rank mesh in `ranks.reshape`. A
tensor-parallel group of CPU ranks on one node all-reduces through shared memory
(shm_communicator.py); of GPUs of one node with peer access, small tensors through their mapped
memory (custom_all_reduce.py); the rest through Gloo or NCCL.
Layers ask `get_tp_group()` for tp_rank/tp_size, never the world size, so TP and PP compose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.engine import envs


@dataclass
class GroupCoordinator:
    """One process group and this rank's place in it, with the collectives layers use."""

    ranks: list[int]
    rank: int  # global rank of this process
    device_group: Any = field(default=None, repr=False)  # torch ProcessGroup for tensors
    cpu_group: Any = field(default=None, repr=False)  # Gloo group for Python objects
    shm: Any = field(default=None, repr=False)  # ShmCommunicator when all ranks share a node
    custom: Any = field(default=None, repr=False)  # CustomAllReduce: GPUs of a node, peer access

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, tensor):
        if self.world_size == 1:
            return tensor
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.all_reduce(tensor.contiguous())
        if self.custom is not None and self.custom.fits(tensor):  # small, GPUs of one node
            return self.custom.all_reduce(tensor)
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor):
        """[n, ...] on every rank (the same n) -> [world_size * n, ...], in rank order."""
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor, group=self.device_group)
        return torch.cat(pieces)

    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order. A tensor, never a pickle: nothing a peer sends
        over torch.distributed is unpickled (its connections are not authenticated)."""
        if self.world_size == 1:
            return [value]
        import torch
        import torch.distributed as dist

        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=self.cpu_group)
        return [int(t.item()) for t in out]

    def gather(self, tensor, dim: int = -1, sizes: list[int] | None = None):
        """Concatenate the ranks' tensors along `dim` on the group's first rank (None elsewhere).

        `sizes` (each rank's extent along `dim`) may differ (uneven tensor parallelism): shards
        are padded to the largest for the collective and trimmed after. Unknown sizes cost one
        extra object collective.
        """
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        sizes = sizes or self.all_gather_int(tensor.shape[dim])
        largest = max(sizes)
        if self.shm is not None:
            per_unit = tensor.numel() // max(tensor.shape[dim], 1) * tensor.element_size()
            if largest * per_unit <= self.shm.capacity:  # the same answer on every rank
                return self.shm.gather(tensor, dim % tensor.dim(), sizes)
        if tensor.shape[dim] != largest:
            pad_shape = list(tensor.shape)
            pad_shape[dim] = largest - tensor.shape[dim]
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
        tensor = tensor.contiguous()
        if self.is_first_rank:
            pieces = [torch.empty_like(tensor) for _ in sizes]
            dist.gather(tensor, pieces, dst=self.ranks[0], group=self.device_group)
            return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, sizes, strict=True)], dim)
        dist.gather(tensor, None, dst=self.ranks[0], group=self.device_group)
        return None

    def send_tensor_dict(self, tensors: dict, dst_in_group: int) -> list:
        """Send each tensor (in key order) to a rank of this group; returns the pending sends."""
        import torch.distributed as dist

        dst = self.ranks[dst_in_group]
        return [
            dist.isend(tensors[key].contiguous(), dst, group=self.device_group)
            for key in sorted(tensors)
        ]

    def recv_tensor_dict(self, buffers: dict, src_in_group: int) -> dict:
        """Fill `buffers` (preallocated, keyed like the sender's dict) from a rank of this group."""
        import torch.distributed as dist

        src = self.ranks[src_in_group]
        for key in sorted(buffers):
            dist.recv(buffers[key], src, group=self.device_group)
        return buffers


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_EP: GroupCoordinator | None = None
_DP: GroupCoordinator | None = None


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


def get_ep_group() -> GroupCoordinator | None:
    """The expert-parallel group (MoE layers hold whole experts per rank), or None when expert
    parallelism is off (each expert is split by tensor parallelism). Its ranks are the tensor-
    parallel group's (EP size = TP size), or with data-parallel replicas sharing one world
    every rank of it (EP size = DP x TP)."""
    return _EP


def get_dp_group() -> GroupCoordinator | None:
    """The data-parallel group: this rank and the ranks at the same place of the other
    replicas, when the replicas share one world (expert parallelism across data-parallel
    replicas: MoE layers exchange tokens over it); None otherwise."""
    return _DP


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    backend: str,
    timeout_s: float = 600.0,
) -> None:
    """Join the world: Gloo on the CPU, NCCL on CUDA (with a Gloo group for Python objects)."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def initialize_model_parallel(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    enable_expert_parallel: bool = False,
    data_parallel_size: int = 1,
) -> None:
    """Create this rank's TP and PP groups from the rank mesh (ranks.reshape); with
    `enable_expert_parallel`, the EP group (the TP group's ranks and communicators).

    `data_parallel_size` > 1: the world is that many replicas' (ranks.dp_worlds; expert
    parallelism across data-parallel replicas): every replica's TP and PP groups, the DP groups
    (ranks.dp_groups) and an EP group of the whole world.

    Every rank creates every group, in the same order, as torch.distributed requires.
    """
    import torch.distributed as dist

    from llmctl.engine.distributed import ranks

    rank = dist.get_rank()
    backend = dist.get_backend()
    dp, pp, tp = data_parallel_size, pipeline_parallel_size, tensor_parallel_size
    worlds = ranks.dp_worlds(dp, pp, tp)
    kinds = {
        "tp": [row for world in worlds for row in world],
        "pp": [[world[p][t] for p in range(pp)] for world in worlds for t in range(tp)],
    }
    if dp > 1:
        kinds["dp"] = ranks.dp_groups(dp, pp, tp)
        kinds["ep"] = [list(range(dp * pp * tp))] if enable_expert_parallel else []
    mine: dict[str, GroupCoordinator] = {}
    for kind, group_ranks_list in kinds.items():
        for group_ranks in group_ranks_list:
            device_group = dist.new_group(group_ranks, backend=backend)
            cpu_group = (
                device_group if backend == "gloo" else dist.new_group(group_ranks, backend="gloo")
            )
            if rank in group_ranks:
                mine[kind] = GroupCoordinator(group_ranks, rank, device_group, cpu_group)
    tp_group = mine["tp"]
    set_groups(tp_group, mine["pp"])
    _attach_shared_memory(tp_group)
    if backend == "nccl" and tp_group.world_size > 1:
        from llmctl.engine.distributed import custom_all_reduce

        custom_all_reduce.attach(tp_group, envs.LLMCTL_CUSTOM_ALL_REDUCE)
    global _DP
    _DP = mine.get("dp")
    set_ep_group(mine.get("ep", tp_group) if enable_expert_parallel else None)


def _attach_shared_memory(group: GroupCoordinator) -> None:
    """Give a CPU group whose ranks share one node a shared-memory communicator."""
    import socket

    import torch.distributed as dist

    if group.world_size == 1 or dist.get_backend() != "gloo":
        return
    if not envs.LLMCTL_SHM_COLLECTIVES:
        return
    from llmctl.engine.distributed.shm_communicator import ShmCommunicator, host_id

    if len(set(group.all_gather_int(host_id(socket.gethostname())))) == 1:
        group.shm = ShmCommunicator(group.cpu_group, group.rank_in_group, group.world_size)


def destroy_distributed_environment() -> None:
    import torch.distributed as dist

    for group in (_TP, _PP):
        if group is not None and group.shm is not None:
            group.shm.close()
    reset_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def set_groups(tp: GroupCoordinator, pp: GroupCoordinator) -> None:
    global _TP, _PP
    _TP, _PP = tp, pp


def set_ep_group(ep: GroupCoordinator | None) -> None:
    global _EP
    _EP = ep


def reset_groups() -> None:
    global _TP, _PP, _EP, _DP
    _TP = _PP = _EP = _DP = None
