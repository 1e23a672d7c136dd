"""The planner's memory model: what each rank of a TP x PP layout holds (weights, profile-step
activations, memory outside torch) and how many KV blocks the rest buys, with the engine's own
arithmetic (engine/config/memory_profile.py) on estimates; the uneven pipeline split that evens
out the stages' KV room."""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.cluster.inventory import Inventory
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.plan import RankMemory
from llmctl.cluster.plan.plan_options import PlanOptions
from llmctl.cluster.plan.weight_format import (
    WeightFormats,
    dense_format,
)
from llmctl.engine.config.engine_config import (
    DTYPE_BYTES,
    check_expert_parallel,
    normalize_dtype,
    resolve_max_num_batched_tokens,
)
from llmctl.engine.config.kv_cache_layout import KVCacheLayout
from llmctl.engine.config.memory_profile import (
    DEFAULT_CPU_KV_CACHE_SPACE_GIB,
    GIB,
    MemoryProfile,
    cpu_num_gpu_blocks,
    estimate_activation_bytes,
    estimate_non_torch_bytes,
    profile_request_lengths,
)
from llmctl.engine.distributed import ranks as rank_mesh
from llmctl.engine.distributed.partition import layer_partition
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.quantization.quant_config import check_whole_groups


@dataclass(frozen=True)
class PlanContext:
    spec: ModelSpec
    inventory: Inventory
    options: PlanOptions
    dtype: str
    dtype_bytes: int
    weights: WeightFormats  # each weight's storage: the dtype, GGUF blocks or quantized groups
    kv_bytes: int
    max_model_len: int
    gpu_gib: float  # memory of one device
    gpus_per_node: int
    nodes: int
    num_tokens: int  # the engine's profile step: tokens ...
    num_sampled: int  # ... and sampled rows
    kv_layout: KVCacheLayout  # how the layers share the KV cache, as the engine has it

    def needed_blocks(self) -> int:
        """Blocks min_concurrency requests of max_model_len hold at most."""
        opts = self.options
        if not any(self.kv_layout.sliding_windows):
            return -(-self.max_model_len * opts.min_concurrency // opts.block_size)
        per_request = self.kv_layout.request_blocks(self.max_model_len, self.num_tokens)
        return per_request * opts.min_concurrency


def resolve_context(spec: ModelSpec, inventory: Inventory, options: PlanOptions) -> PlanContext:
    from llmctl.engine.platform import resolve_dtype

    dtype = resolve_dtype(normalize_dtype(options.dtype), options.device, _ckpt(spec.dtype))
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = dtype_bytes  # the KV cache is held in the model's dtype, as the engine holds it
    dense = dense_format(dtype, dtype_bytes)
    if spec.prequantized:
        fp8 = spec.weight_formats.source == "FP8 checkpoint"
        if options.quantization is not None and not (fp8 and options.quantization == "fp8"):
            own = "its FP8 blocks are" if fp8 else "the GGUF's own types are"
            raise ConfigError(
                f"{spec.name} is already quantized ({spec.weight_formats.label()}); "
                f"--quantization {options.quantization} quantizes float checkpoints",
                f"drop --quantization: {own} served as they are",
            )
        weights = spec.weight_formats.with_dense(dense)
    else:
        weights = WeightFormats.for_quantization(dense, options.quantization)
        if options.quantization is not None:
            check_whole_groups(spec.shape, options.quantization)
    max_len = options.max_model_len or spec.max_position_embeddings
    if max_len > spec.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_len} exceeds {spec.name}'s {spec.max_position_embeddings} tokens",
            f"use --max-model-len {spec.max_position_embeddings} or less",
        )
    gpus = [n.gpus for n in inventory.nodes]
    if options.device == "cuda":
        missing = [n.host for n in inventory.nodes if n.gpus and n.gpu_memory_gib is None]
        if missing:
            raise ConfigError(
                f"the inventory gives no gpu_memory_gib for {', '.join(missing)}",
                "add gpu_memory_gib to every node with GPUs (or --gpu-memory-gib)",
            )
        if not any(gpus):
            raise ConfigError("the inventory has no GPU", "give the nodes `gpus:` counts")
        gpu_gib = min(n.gpu_memory_gib for n in inventory.nodes if n.gpus)
    else:
        gpu_gib = 0.0
    if options.enable_expert_parallel:
        check_expert_parallel(spec.shape)
    num_tokens = resolve_max_num_batched_tokens(
        options.max_num_batched_tokens, options.max_num_seqs
    )
    requests = profile_request_lengths(num_tokens, options.max_num_seqs, max_len)
    return PlanContext(
        spec=spec,
        inventory=inventory,
        options=options,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        weights=weights,
        kv_bytes=kv_bytes,
        max_model_len=max_len,
        gpu_gib=gpu_gib,
        gpus_per_node=min(g for g in gpus if g) if any(gpus) else 1,
        nodes=len([g for g in gpus if g]) or len(gpus),
        num_tokens=num_tokens,
        num_sampled=len(requests),
        kv_layout=KVCacheLayout.for_shape(spec.shape, max_len, options.block_size),
    )


def _ckpt(dtype: str) -> str | None:
    try:
        return normalize_dtype(dtype)
    except ConfigError:
        return None


def rank_memory(ctx: PlanContext, tp: int, pp: int, parts: list[int]) -> list[RankMemory]:
    shape, opts = ctx.spec.shape, ctx.options
    out = []
    starts = [sum(parts[:i]) for i in range(pp)]
    for pp_rank, row in enumerate(rank_mesh.reshape(pp, tp)):
        layers = parts[pp_rank]
        first, last = pp_rank == 0, pp_rank == pp - 1
        for tp_rank, rank in enumerate(row):
            span = (starts[pp_rank], starts[pp_rank] + layers)
            weights = ctx.weights.rank_bytes(
                shape,
                span,
                tp_rank,
                tp,
                is_first=first,
                is_last=last,
                expert_parallel=opts.enable_expert_parallel,
            )
            # one block: a slot range of each KV tensor of the stage (one per layer, or
            # shared by the layers of several KV cache groups)
            tensors = ctx.kv_layout.num_tensors(*span)
            block = shape.kv_cache_bytes_per_block(
                tensors, tp_rank, tp, ctx.kv_bytes, opts.block_size
            )
            if opts.device == "cpu":
                # The engine's own arithmetic: the KV budget over this rank's block bytes.
                activation = non_torch = 0
                num_blocks = cpu_num_gpu_blocks(opts.kv_cache_space_gib, block)
                kv = int((opts.kv_cache_space_gib or DEFAULT_CPU_KV_CACHE_SPACE_GIB) * GIB)
            else:
                activation = activation_bytes(ctx, tp_rank, tp, last)
                non_torch = estimate_non_torch_bytes(tp * pp)
                profile = MemoryProfile(
                    total_bytes=gpu_bytes(ctx),
                    weight_bytes=weights,
                    peak_torch_bytes=weights + activation,
                    non_torch_bytes=non_torch,
                )
                kv = max(profile.kv_cache_bytes(opts.gpu_memory_utilization), 0)
                num_blocks = kv // block if block else 0
            out.append(
                RankMemory(
                    rank=rank,
                    node=rank // ctx.gpus_per_node if opts.device == "cuda" else 0,
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    layers=(starts[pp_rank], starts[pp_rank] + layers),
                    weight_bytes=weights,
                    activation_bytes=activation,
                    non_torch_bytes=non_torch,
                    kv_bytes=kv,
                    kv_block_bytes=block,
                    num_blocks=num_blocks,
                )
            )
    return out


def gpu_bytes(ctx: PlanContext) -> int:
    return int(ctx.gpu_gib * GIB)


def activation_bytes(ctx: PlanContext, tp_rank: int, tp: int, is_last_stage: bool) -> int:
    """This rank's peak activations in the engine's profile step (see
    estimate_activation_bytes). A MoE layer's are estimated as one dense MLP of
    intermediate_size; its weights are counted in full (every expert, ModelShape.moe_params)."""
    shape = ctx.spec.shape
    shard = shape.head_shard(tp_rank, tp)
    return estimate_activation_bytes(
        num_tokens=ctx.num_tokens,
        num_sampled=ctx.num_sampled,
        hidden_size=shape.hidden_size,
        qkv_size=(shard.num_q_heads + 2 * shard.num_kv_heads) * shape.head_dim,
        intermediate_size=shape.intermediate_shard(tp_rank, tp),
        vocab_shard=shape.vocab_shard(tp_rank, tp),
        vocab_size=shape.vocab_size,
        dtype_bytes=ctx.dtype_bytes,
        gated_mlp=shape.family in ("llama", "gemma3"),
        is_last_stage=is_last_stage,
        samples=is_last_stage and tp_rank == 0,
    )


@dataclass(frozen=True)
class Evaluation:
    tp: int
    pp: int
    parts: tuple[int, ...]
    ranks: tuple[RankMemory, ...]
    default_parts: bool

    @property
    def blocks(self) -> int:
        return min(r.num_blocks for r in self.ranks)

    def fits(self, ctx: PlanContext) -> bool:
        return self.blocks >= ctx.needed_blocks()


def evaluate(
    ctx: PlanContext, tp: int, pp: int, explicit: tuple[int, ...] | None = None
) -> Evaluation:
    default = layer_partition(ctx.spec.num_layers, pp)
    parts = list(layer_partition(ctx.spec.num_layers, pp, explicit)) if explicit else default
    ranks = rank_memory(ctx, tp, pp, parts)
    evaluation = Evaluation(tp, pp, tuple(parts), tuple(ranks), list(parts) == default)
    if pp > 1 and explicit is None:
        balanced = balanced_partition(ctx, tp, pp)
        if balanced is not None and balanced != default:
            candidate = rank_memory(ctx, tp, pp, balanced)
            if min(r.num_blocks for r in candidate) > evaluation.blocks:
                evaluation = Evaluation(tp, pp, tuple(balanced), tuple(candidate), False)
    return evaluation


def balanced_partition(ctx: PlanContext, tp: int, pp: int) -> list[int] | None:
    """The layer split that maximizes the smallest stage's KV blocks.

    A stage with L layers on tensor-parallel rank t holds B blocks when
        usable - activation_t - reserve - fixed_s,t - L * layer_t >= B * L * block_t
    (fixed: the embedding on the first stage, norm and LM head on the last). So at a target B a
    stage can take at most L_s(B) layers; binary search the largest B whose L_s(B) cover the model.
    """
    if ctx.options.device == "cpu":
        return None  # the KV budget is per rank, independent of the weights
    spec, shape, opts = ctx.spec, ctx.spec.shape, ctx.options
    usable = int(gpu_bytes(ctx) * opts.gpu_memory_utilization)
    non_torch = estimate_non_torch_bytes(tp * pp)
    stages = []  # per stage: [(room, layer_bytes, block_bytes_per_layer) per tp rank]
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        per_rank = []
        for t in range(tp):
            fixed = ctx.weights.rank_bytes(shape, (0, 0), t, tp, is_first=first, is_last=last)
            room = usable - activation_bytes(ctx, t, tp, last) - non_torch - fixed
            layer_bytes = ctx.weights.max_layer_bytes(shape, t, tp, opts.enable_expert_parallel)
            block = shape.kv_cache_bytes_per_block(1, t, tp, ctx.kv_bytes, opts.block_size)
            # layers sharing KV tensors (several KV cache groups): about this much per layer
            block = block * ctx.kv_layout.num_tensors(0, spec.num_layers) // spec.num_layers
            per_rank.append((room, layer_bytes, block))
        stages.append(per_rank)

    def caps(blocks: int) -> list[int]:
        return [
            min(max(room, 0) // (layer + blocks * block) for room, layer, block in per_rank)
            for per_rank in stages
        ]

    def split(limits: list[int]) -> list[int] | None:
        if min(limits) < 1 or sum(limits) < spec.num_layers:
            return None
        parts = [1] * pp
        for _ in range(spec.num_layers - pp):
            # The stage with the most room left takes the next layer (ties: the smaller stage).
            stage = max(range(pp), key=lambda s: (limits[s] - parts[s], -parts[s]))
            parts[stage] += 1
        return parts

    low, high, best = 1, 1 << 26, None
    while low <= high:
        mid = (low + high) // 2
        parts = split(caps(mid))
        if parts is not None:
            best, low = parts, mid + 1
        else:
            high = mid - 1
    return best
