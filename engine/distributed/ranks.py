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


def coord(rank: int, pp: int, tp: int) -> RankCoord:
    for p, row in enumerate(reshape(pp, tp)):
        if rank in row:
            return RankCoord(rank, p, row.index(rank))
    raise ValueError(f"rank {rank} is not in a world of {pp * tp} ranks")


def output_rank(pp: int, tp: int) -> int:
    """The rank whose execute_model result carries the sampled tokens: last stage, tp_rank 0."""
    return reshape(pp, tp)[-1][0]
