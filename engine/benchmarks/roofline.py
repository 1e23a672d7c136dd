"""ModelCost: the bytes a decode step must read and the FLOPs a prefill must do, per rank.

Counted from the model's shape the way the planner counts it (`ModelShape.rank_params`,
`kv_bytes_per_token`: the same partition functions the layers split with), one pipeline stage at
a time, on its largest tensor-parallel rank (rank 0: uneven head splits give it the most):

- a decode step of B sequences reads the stage's weights once (the LM head whole; of the token
  embedding only B rows, which are not counted), the K and V of every context token of every
  sequence, and writes one token's K and V per sequence; a mixture of experts reads only the
  experts its B x top-k routes reach, E * (1 - (1 - k/E)^B) of them in expectation;
- a prefill of a prompt of L tokens multiplies every layer weight by every token (2 FLOPs per
  weight per token), the LM head by the last token only, and does 4 * head_dim FLOPs per query
  head, layer and visible (query, key) pair: L (L + 1) / 2 of them, causal.

Stages run one after another on one batch, so a step's time at the device's limit is the sum of
its stages' bytes over the bandwidth (decode), or FLOPs over the peak (prefill).
Where the engine reports what each rank holds (Worker.rank_info's weight_bytes: exact for
quantized weights), that replaces the shape's count for the stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmctl.engine.config.engine_config import DTYPE_BYTES, EngineConfig
from llmctl.engine.distributed.partition import column_shards, layer_partition


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage, on its largest tensor-parallel rank."""

    dense_weight_bytes: int  # read by every decode step (routed experts apart)
    expert_params: int  # the routed experts' weights on the rank, all layers (0: dense)
    weight_bytes: int  # bytes per weight of the experts (the model's dtype)
    kv_bytes_per_token: int  # K and V of one token over the stage's layers
    matmul_params: int  # weights each prompt token multiplies (LM head and routed experts apart)
    lm_head_params: int  # multiplied by each sequence's last prompt token
    attention_flops_per_pair: int  # one (query, key) pair over every query head and layer


@dataclass(frozen=True)
class ModelCost:
    stages: tuple[StageCost, ...]
    num_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def from_config(cls, config: EngineConfig, rank_info: Sequence[dict] = ()) -> ModelCost:
        """The cost of the engine's layout; `rank_info` (Executor.rank_info()) gives the bytes
        each rank really holds, which replace the shape's count of its stage's dense weights."""
        mc, pc = config.model_config, config.parallel_config
        shape, tp, pp = mc.shape, pc.tensor_parallel_size, pc.pipeline_parallel_size
        dtype_bytes = DTYPE_BYTES[mc.dtype]
        held = _held_bytes(rank_info)
        partition = layer_partition(shape.num_layers, pp, pc.pipeline_layer_partition)
        stages = []
        for stage, layers in enumerate(partition):
            first, last = stage == 0, stage == pp - 1
            routed = layers * _routed_expert_params(shape, tp)
            params = shape.rank_params(layers, 0, tp, is_first=first, is_last=last)
            embedding = shape.embedding_params(0, tp) if first else 0
            lm_head = shape.vocab_shard(0, tp) * shape.embedding_width if last else 0
            # The embedding table is read a row per token, unless it is the tied LM head too.
            unread = 0 if (last and shape.tie_word_embeddings) else embedding
            dense_bytes = (params - unread - routed) * dtype_bytes
            if stage in held:
                dense_bytes = max(held[stage] - (unread + routed) * dtype_bytes, 0)
            stages.append(
                StageCost(
                    dense_weight_bytes=dense_bytes,
                    expert_params=routed,
                    weight_bytes=dtype_bytes,
                    kv_bytes_per_token=shape.kv_bytes_per_token(layers, 0, tp, dtype_bytes),
                    matmul_params=_matmul_params(shape, tp, layers, first, last),
                    lm_head_params=lm_head,
                    attention_flops_per_pair=4
                    * shape.head_dim
                    * shape.head_shard(0, tp).num_q_heads
                    * layers,
                )
            )
        return cls(tuple(stages), shape.num_experts, shape.num_experts_per_tok)

    # -- decode ------------------------------------------------------------------------------------

    def decode_step_bytes(self, context_lens: Sequence[int]) -> int:
        """Bytes one decode step reads and writes, summed over the stages (each on its largest
        rank): sequences whose KV holds `context_lens` tokens before the step."""
        batch, context = len(context_lens), sum(context_lens)
        reached = self._experts_reached(batch)
        return sum(
            s.dense_weight_bytes
            + round(s.expert_params * s.weight_bytes * reached)
            + s.kv_bytes_per_token * (context + batch)
            for s in self.stages
        )

    def decode_bytes(self, prompt_lens: Sequence[int], output_len: int) -> int:
        """All decode steps of a batch generating `output_len` tokens each after its prompts
        (the first token comes from the prefill)."""
        steps = range(output_len - 1)
        return sum(self.decode_step_bytes([n + step for n in prompt_lens]) for step in steps)

    def _experts_reached(self, tokens: int) -> float:
        """The expected fraction of a layer's experts that `tokens` tokens route to."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** tokens

    # -- prefill -----------------------------------------------------------------------------------

    def prefill_flops(self, prompt_lens: Sequence[int]) -> int:
        """FLOPs of prefilling these prompts (no cached prefix), summed over the stages."""
        tokens = sum(prompt_lens)
        pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
        share = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return sum(
            round(2 * (s.matmul_params + s.expert_params * share) * tokens)
            + 2 * s.lm_head_params * len(prompt_lens)
            + s.attention_flops_per_pair * pairs
            for s in self.stages
        )


def _matmul_params(shape, tp: int, layers: int, first: bool, last: bool) -> int:
    """The weights a prompt token multiplies on tp_rank 0 of a stage: the attention and MLP
    matrices (a MoE layer's router and shared expert; its routed experts apart), OPT's
    project_in/out; not the norms, biases, embeddings or LM head."""
    h, d = shape.hidden_size, shape.head_dim
    heads = shape.head_shard(0, tp)
    q, kv = heads.num_q_heads * d, heads.num_kv_heads * d
    inter = shape.intermediate_shard(0, tp)
    if shape.family != "llama":  # GPT-2, OPT: two MLP matrices
        per_layer = h * (q + 2 * kv) + q * h + 2 * h * inter
    elif shape.num_experts:
        per_layer = h * (q + 2 * kv) + q * h + h * shape.num_experts  # attention, router
        if shape.shared_expert_intermediate_size:
            shared = column_shards(shape.shared_expert_intermediate_size, tp, "shared features")
            per_layer += 3 * h * shared[0] + h  # the shared expert and its gate
    else:
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    project = shape.embedding_width * h if shape.embedding_width != h else 0
    return layers * per_layer + project * (first + last)


def _routed_expert_params(shape, tp: int) -> int:
    """One MoE layer's routed experts on tp_rank 0 (each a slice of the expert's features)."""
    if not shape.num_experts:
        return 0
    inter = column_shards(shape.expert_intermediate_size, tp, "expert MLP features")[0]
    return shape.num_experts * 3 * shape.hidden_size * inter


def _held_bytes(rank_info: Sequence[dict]) -> dict[int, int]:
    """pp_rank -> the most weight bytes a rank of that stage holds."""
    held: dict[int, int] = {}
    for info in rank_info:
        stage = info.get("pp_rank", 0)
        held[stage] = max(held.get(stage, 0), int(info.get("weight_bytes", 0)))
    return held


def roofline_report(limit, prefill_flops: int, decode_bytes: int, elapsed: float) -> dict:
    """What a run of `elapsed` seconds reached: the time the device would take at its limit
    (prefill FLOPs at the peak, then decode bytes at the bandwidth) over the time it took."""
    prefill_s = prefill_flops / limit.peak_flops
    decode_s = decode_bytes / limit.bandwidth
    return {
        "device_limit": limit.as_dict(),
        "prefill_flops": prefill_flops,
        "decode_bytes": decode_bytes,
        "limit_seconds": {"prefill": prefill_s, "decode": decode_s},
        "fraction_of_limit": (prefill_s + decode_s) / elapsed if elapsed > 0 else None,
    }
