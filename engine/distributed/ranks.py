"""The rank mesh: which global rank is which (pipeline stage, tensor-parallel rank). Pure.

Built in exactly one place, `reshape`, used by the planner, the executors and parallel_state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoord:
    rank: int
    pp_rank: int
    tp_rank: int


def reshape(pp: int, tp: int) -> list[list[int]]:
    """Global ranks as a [pp][tp] grid: rank = pp_rank * tp + tp_rank.

    A tensor-parallel group is a row (one pipeline stage, packed on one node); a pipeline group is
    a column (the same tp_rank in every stage). With 8 GPUs as tp=4 x pp=2:

        reshape(2, 4) == [[0, 1, 2, 3],    # stage 0: TP group of ranks 0-3 (node A)
                          [4, 5, 6, 7]]    # stage 1: TP group of ranks 4-7 (node B)

    TP groups are the rows [0, 1, 2, 3] and [4, 5, 6, 7]; PP groups the columns [0, 4], [1, 5],
    [2, 6], [3, 7]. Rank 4 receives stage 0's hidden states from rank 0; the sampled tokens come
    from rank 4 (last stage, tp_rank 0).
    """
    if pp < 1 or tp < 1:
        raise ValueError(f"pp and tp must be positive, got pp={pp}, tp={tp}")
    return [[p * tp + t for t in range(tp)] for p in range(pp)]


def tp_groups(pp: int, tp: int) -> list[list[int]]:
    return reshape(pp, tp)


def pp_groups(pp: int, tp: int) -> list[list[int]]:
    grid = reshape(pp, tp)
    return [[grid[p][t] for p in range(pp)] for t in range(tp)]


def dp_worlds(dp: int, pp: int, tp: int) -> list[list[list[int]]]:
    """The ranks of one torch.distributed world shared by `dp` data-parallel replicas (expert
    parallelism across replicas): replica d's mesh is reshape(pp, tp) shifted by d * pp * tp, so
    a worker's global rank is dp_rank * pp * tp + its rank in the replica. dp=2 x tp=2:

        dp_worlds(2, 1, 2) == [[[0, 1]],    # replica 0: TP group 0-1
                               [[2, 3]]]    # replica 1: TP group 2-3

    Every replica's TP and PP groups are these rows and columns; the data-parallel groups
    (dp_groups) join the ranks at the same place of every replica; the expert-parallel group is
    the whole world (EP size = DP x TP).
    """
    size = pp * tp
    return [[[size * d + r for r in row] for row in reshape(pp, tp)] for d in range(dp)]


def dp_groups(dp: int, pp: int, tp: int) -> list[list[int]]:
    """[[0, 2], [1, 3]] for dp=2 x tp=2: the same (pp_rank, tp_rank) of every replica."""
    worlds = dp_worlds(dp, pp, tp)
    return [[worlds[d][p][t] for d in range(dp)] for p in range(pp) for t in range(tp)]


def coord(rank: int, pp: int, tp: int) -> RankCoord:
    for p, row in enumerate(reshape(pp, tp)):
        if rank in row:
            return RankCoord(rank, p, row.index(rank))
    raise ValueError(f"rank {rank} is not in a world of {pp * tp} ranks")


def output_rank(pp: int, tp: int) -> int:
    """The rank whose execute_model result carries the sampled tokens: last stage, tp_rank 0."""
    return reshape(pp, tp)[-1][0]


def node_ranks(node_rank: int, nnodes: int, pp: int, tp: int) -> list[int]:
    """The global ranks node `node_rank` of `nnodes` runs: whole rows of the mesh (pipeline
    stages), so a tensor-parallel group never spans nodes. tp=2 x pp=4 on 2 nodes:

        node_ranks(0, 2, 4, 2) == [0, 1, 2, 3]    # stages 0-1
        node_ranks(1, 2, 4, 2) == [4, 5, 6, 7]    # stages 2-3

    That is ranks r*k .. r*k+k-1 with k = tp*pp // nnodes; local rank = rank - r*k.
    """
    stages = pp // nnodes
    rows = reshape(pp, tp)[node_rank * stages : (node_rank + 1) * stages]
    return [rank for row in rows for rank in row]


def node_of(rank: int, nnodes: int, pp: int, tp: int) -> int:
    return rank // (pp * tp // nnodes)


def span(ranks: list[int]) -> str:
    """[2, 3] -> "2-3", [5] -> "5" (consecutive ranks, as node_ranks gives them)."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def check_nodes(parallel_config) -> None:
    """Refuse a node layout before anything starts: node_rank in range, whole pipeline stages per
    node, the mp backend, a master address."""
    from llmctl.engine.errors import ConfigError

    pc = parallel_config
    tp, pp, nnodes, node_rank = (
        pc.tensor_parallel_size,
        pc.pipeline_parallel_size,
        pc.nnodes,
        pc.node_rank,
    )
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ConfigError(
            f"nnodes must be a positive integer, got {nnodes!r}", "use --nnodes 1 or more"
        )
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"node_rank={node_rank!r} is not a node of --nnodes {nnodes}",
            f"give each node its own --node-rank from 0 to {nnodes - 1} (0 serves the API)",
        )
    world = tp * pp
    if pp % nnodes:
        import math

        divisors = [n for n in range(1, pp + 1) if pp % n == 0]
        if world % nnodes:
            what = f"{world} ranks (tp={tp} x pp={pp}) do not divide over {nnodes} nodes"
        else:
            what = f"{world} ranks on {nnodes} nodes would split a tensor-parallel group of {tp}"
        factor = nnodes // math.gcd(pp, nnodes)
        same_world = f" (e.g. -tp {tp // factor} -pp {pp * factor})" if tp % factor == 0 else ""
        raise ConfigError(
            f"{what}: each node runs whole pipeline stages (tensor parallelism stays inside a "
            "node, stages span nodes)",
            f"use --nnodes {' or '.join(map(str, divisors))} for pipeline_parallel_size={pp}, "
            f"or a -pp divisible by {nnodes}{same_world}",
        )
    backend = pc.distributed_executor_backend
    if nnodes > 1 and backend not in (None, "mp"):
        raise ConfigError(
            f"--nnodes {nnodes} runs on the mp backend, not {backend!r}",
            "use --distributed-executor-backend mp (or leave it out); the Ray backend places "
            "ranks on nodes itself (`llmctl cluster up`)",
        )
    if nnodes > 1 and not pc.master_addr:
        raise ConfigError(
            f"--nnodes {nnodes} needs --master-addr",
            "give every node --master-addr: node 0's address, which every node reaches",
        )
    if not 1 <= pc.master_port <= 65534:
        raise ConfigError(
            f"master_port={pc.master_port} is not a TCP port below 65535",
            "use --master-port 1024-65534 (it and the port after it are used)",
        )
    if pc.rendezvous_timeout <= 0:
        raise ConfigError(
            f"rendezvous_timeout must be positive, got {pc.rendezvous_timeout}",
            "give the nodes some seconds to join, e.g. --rendezvous-timeout 300",
        )
