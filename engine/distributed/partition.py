"""How tensor-parallel ranks share heads, MLP columns and the vocabulary (pure arithmetic).

Uneven tensor parallelism: when tp does not divide the heads, whole KV-head groups (a KV head and
the query heads that read it) are dealt out as evenly as possible, so 9 query heads / 3 KV heads on
tp=2 give rank 0 two groups (6 query heads) and rank 1 one group (3 query heads). When tp exceeds
the KV heads, ranks share a KV head (it is replicated) and split its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.engine.errors import ConfigError


def split_evenly(total: int, parts: int) -> list[int]:
    """[5, 5, 4] for split_evenly(14, 3): sizes differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for size in sizes:
        out.append(acc)
        acc += size
    return out


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank computes."""

    q_start: int  # first query head
    num_q_heads: int
    kv_start: int  # first KV head
    num_kv_heads: int


def valid_tp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    return [tp for tp in range(1, num_heads + 1) if _try_head_shards(num_heads, num_kv_heads, tp)]


def head_shards(num_heads: int, num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """One HeadShard per rank; raises ConfigError naming the valid sizes when none exists."""
    shards = _try_head_shards(num_heads, num_kv_heads, tp_size)
    if shards is None:
        valid = valid_tp_sizes(num_heads, num_kv_heads)
        raise ConfigError(
            f"tensor_parallel_size={tp_size} cannot split {num_heads} attention heads "
            f"({num_kv_heads} KV heads)",
            f"use tensor_parallel_size {', '.join(map(str, valid))}, or keep tp smaller and add "
            f"--pipeline-parallel-size",
        )
    return shards


def _try_head_shards(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard] | None:
    if tp < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        return None
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp <= num_kv_heads:
        kv_sizes = split_evenly(num_kv_heads, tp)
        return [
            HeadShard(q_start=s * group, num_q_heads=n * group, kv_start=s, num_kv_heads=n)
            for s, n in zip(offsets(kv_sizes), kv_sizes, strict=True)
        ]
    # More ranks than KV heads: each KV head is replicated on the ranks that split its group.
    ranks_per_kv = split_evenly(tp, num_kv_heads)
    if max(ranks_per_kv) > group:
        return None  # some rank would get no query head
    shards = []
    for kv, ranks in enumerate(ranks_per_kv):
        q_sizes = split_evenly(group, ranks)
        for start, size in zip(offsets(q_sizes), q_sizes, strict=True):
            shards.append(HeadShard(kv * group + start, size, kv, 1))
    return shards


def column_shards(total: int, tp_size: int, what: str) -> list[int]:
    """Sizes of a split output dimension (MLP intermediate, vocabulary)."""
    if tp_size > total:
        raise ConfigError(
            f"tensor_parallel_size={tp_size} exceeds the {total} {what}",
            f"use tensor_parallel_size {total} or less",
        )
    return split_evenly(total, tp_size)


def expert_shards(num_experts: int, ep_size: int) -> list[int]:
    """Whole experts per expert-parallel rank, dealt out contiguously: 8 on 3 ranks give
    [3, 3, 2] (experts 0-2, 3-5, 6-7)."""
    if ep_size > num_experts:
        raise ConfigError(
            f"expert parallelism over {ep_size} ranks exceeds the model's {num_experts} experts: "
            "some rank would hold none",
            f"use tensor_parallel_size {num_experts} or less with --enable-expert-parallel (with "
            "data-parallel replicas: tensor_parallel_size x data_parallel_size), or leave expert "
            "parallelism off",
        )
    return split_evenly(num_experts, ep_size)


def describe_expert_placement(num_experts: int, ep_size: int) -> str:
    """ "experts 0-2 on rank 0, 3-5 on rank 1, 6-7 on rank 2"."""
    sizes = expert_shards(num_experts, ep_size)
    spans = [
        f"{start}-{start + n - 1}" if n > 1 else str(start)
        for start, n in zip(offsets(sizes), sizes, strict=True)
    ]
    return "experts " + ", ".join(f"{span} on rank {r}" for r, span in enumerate(spans))


@dataclass(frozen=True)
class PipelineShard:
    """The decoder layers one pipeline stage runs: global indices [start_layer, end_layer)."""

    start_layer: int
    end_layer: int
    is_first: bool  # holds the embedding
    is_last: bool  # holds the final norm and LM head


def layer_partition(
    num_layers: int, pp_size: int, explicit: tuple[int, ...] | None = None
) -> list[int]:
    """Layers per stage. Default (vLLM's rule): equal shares, and the remainder goes one layer
    each to the stages before the last, from the second-to-last backwards, because the last
    stage also runs the LM head. 30 layers on 4 stages: [7, 8, 8, 7]."""
    if explicit is not None:
        if len(explicit) != pp_size or sum(explicit) != num_layers:
            raise ConfigError(
                f"pipeline_layer_partition {','.join(map(str, explicit))} has {len(explicit)} "
                f"stages summing to {sum(explicit)}, but the model has {num_layers} layers on "
                f"pipeline_parallel_size={pp_size}",
                f"give {pp_size} positive numbers that sum to {num_layers}",
            )
        return list(explicit)
    if pp_size > num_layers:
        raise ConfigError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers",
            f"use pipeline_parallel_size {num_layers} or less",
        )
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def pipeline_shard(
    num_layers: int, pp_rank: int, pp_size: int, explicit: tuple[int, ...] | None = None
) -> PipelineShard:
    parts = layer_partition(num_layers, pp_size, explicit)
    start = sum(parts[:pp_rank])
    return PipelineShard(start, start + parts[pp_rank], pp_rank == 0, pp_rank == pp_size - 1)
