"""make_plan: choose the TP x PP layout for a model on an inventory, and predict its KV cache.

Pure: a ModelSpec and an Inventory in, a Plan out (no SSH, no torch, no mutation).

Memory per GPU is sized by the engine's own arithmetic (engine/config/memory_profile.py), on
estimates of what the engine measures: the weights each rank really holds (ModelShape counts the
engine's shards: its layers, the embedding on the first stage, the final norm and LM head on the
last; in bytes of each weight's storage, cluster/plan/weight_format.py: the dtype, a GGUF
file's blocks, or --quantization's groups), the
peak activations of the profile step at max_num_batched_tokens, and the memory outside torch (the
CUDA context, NCCL); the rest of gpu_memory_utilization x memory is KV cache. The KV cache has as
many blocks as the rank with the fewest can hold, as the engine does. On the CPU the KV cache is
kv_cache_space_gib exactly, as the engine allocates it, so the block count is the engine's own
(`cpu_num_gpu_blocks` over `ModelShape.kv_cache_bytes_per_block`).

The rules, from vLLM's distributed-serving guide, then better:
  1. The model fits one GPU with room for min_concurrency requests of max_model_len: tp=1.
  2. Else it fits one node: the smallest tensor-parallel size that fits (a size that divides the
     heads, unless uneven TP is allowed); the node's full width is offered for throughput.
     Without NVLink (PCIe), pipeline stages inside the node instead: activations cross the link
     once per stage, not twice per layer.
  3. If only a tp that does not divide the heads would fit: tp=1, pp = that many GPUs. The
     uneven tp (whole KV-head groups per rank, which our engine runs and vLLM cannot) is offered
     next to it as "llmctl only", and chosen with --allow-uneven-tp.
  4. Else across nodes: tp = GPUs per node, pp = the fewest nodes that fit.
  5. A float checkpoint that no layout holds: the same rules on its weight-only quantization,
     int8, else int4, printed with its --quantization flag. A quantized layout splits every
     row-parallel layer's inputs on whole quantization groups, as the engine requires.
Pipeline stages get an uneven layer split when it holds more KV cache (the first and last stages
carry the embedding and LM head), printed as --pipeline-layer-partition.
Data parallel (`--data-parallel-size N`, engine/dp/dp_async_llm.py): a layout that fits one node in
fewer GPUs than the node has (and was not asked with -tp/-pp) is proposed as replicas, as many
as the node holds (each its own engine and KV cache: N replicas serve about N times the
requests); the plan prints the KV tokens and concurrency per replica and in total. An asked N
plans one replica on the node's GPUs / N. With several GPU nodes and a layout that fits one, the
replicas span the nodes (vLLM's multi-node data parallel: the head serves the API with its
--data-parallel-size-local replicas, every other node runs its own with --headless), one serve
command per node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from llmctl.cluster.errors import PlanError
from llmctl.cluster.inventory import Inventory
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.weight_format import (
    QUANTIZATION_SCHEMES,
    WeightFormats,
    dense_format,
    quantization_format,
)
from llmctl.engine.config.engine_args import engine_args_to_argv, engine_default
from llmctl.engine.config.engine_config import (
    DTYPE_BYTES,
    ParallelConfig,
    SchedulerConfig,
    check_expert_parallel,
    normalize_dtype,
    resolve_max_num_batched_tokens,
)
from llmctl.engine.config.memory_profile import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_CPU_KV_CACHE_SPACE_GIB,
    GIB,
    NCCL_BYTES,
    SAMPLER_BYTES_PER_LOGIT,
    MemoryProfile,
    check_gpu_memory_utilization,
    cpu_num_gpu_blocks,
    estimate_activation_bytes,
    estimate_non_torch_bytes,
    profile_request_lengths,
)
from llmctl.engine.distributed import ranks as rank_mesh
from llmctl.engine.distributed.partition import layer_partition, valid_tp_sizes
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.quantization.quant_config import check_whole_groups

_KV_DTYPES = {"auto": None, "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
              "fp8_e5m2": 1}  # fmt: skip


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for. The fields named as EngineArgs' mean the same and default the same."""

    dtype: str = engine_default("dtype")
    max_model_len: int | None = engine_default("max_model_len")
    gpu_memory_utilization: float = engine_default("gpu_memory_utilization")
    kv_cache_dtype: str = "auto"
    min_concurrency: int = 1
    block_size: int = engine_default("block_size")
    max_num_batched_tokens: int | None = engine_default("max_num_batched_tokens")
    max_num_seqs: int = engine_default("max_num_seqs")
    allow_uneven_tp: bool = False
    tensor_parallel_size: int | None = None  # force a layout instead of choosing one
    pipeline_parallel_size: int | None = None
    pipeline_layer_partition: tuple[int, ...] | None = None
    device: str = "cuda"  # "cpu": plan for llmctl's CPU engine on this inventory's nodes
    kv_cache_space_gib: float | None = engine_default("kv_cache_space_gib")  # CPU, per rank
    # Weight-only quantization of a float checkpoint (int8, int4): `llmctl serve --quantization`.
    quantization: str | None = engine_default("quantization")
    # A MoE model's experts whole per tensor-parallel rank (`--enable-expert-parallel`).
    enable_expert_parallel: bool = engine_default("enable_expert_parallel")
    # Engine replicas (`--data-parallel-size`); None: as many as the node holds.
    data_parallel_size: int | None = None

    def __post_init__(self) -> None:
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if self.quantization is not None:
            quantization_format(self.quantization)
        SchedulerConfig(  # the engine's checks of the step's size
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or self.max_num_seqs,
        )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
                "allow a positive token budget per step",
            )
        if self.min_concurrency < 1:
            raise ConfigError(
                f"min_concurrency must be at least 1, got {self.min_concurrency}",
                "ask for at least one request",
            )
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ConfigError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}",
                f"use one of {', '.join(_KV_DTYPES)}",
            )
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"unknown device {self.device!r}", "use cuda or cpu")
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ConfigError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}",
                "pass --data-parallel-size 1 or more",
            )


@dataclass(frozen=True)
class RankMemory:
    rank: int
    node: int
    pp_rank: int
    tp_rank: int
    layers: tuple[int, int]
    weight_bytes: int
    activation_bytes: int  # peak of the profile step (estimated)
    non_torch_bytes: int  # CUDA context, NCCL (estimated)
    kv_bytes: int
    kv_block_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class Plan:
    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nodes_used: int
    gpus_used: int
    layer_partition: tuple[int, ...]
    default_partition: bool
    distributed_executor_backend: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    ranks: tuple[RankMemory, ...]
    reasons: tuple[str, ...]
    rejected: tuple[tuple[str, str], ...]  # (layout, why not)
    alternatives: tuple[tuple[str, str], ...] = ()  # (layout, what it offers)
    commands: dict[str, str] = field(default_factory=dict)
    # The EngineArgs keywords of commands["serve"], layout first (None: the engine's default):
    # what a Kubernetes manifest's `llmctl serve` gives (cluster/plan/manifests.py).
    serve_args: dict[str, object] = field(default_factory=dict)
    device: str = "cuda"
    gpu_memory_utilization: float = 0.9
    gpu_memory_bytes: int = 0  # of one GPU (the smallest of the inventory)
    profile_num_tokens: int = 0  # the engine's profile step: tokens, and requests sampled
    profile_num_sampled: int = 0
    quantization: str | None = None  # --quantization of the serve command
    weight_format: str = ""  # what the weights are held in: "bfloat16", "int4", "Q4_1 GGUF"
    weight_format_detail: str = ""  # by role, when quantized
    data_parallel_size: int = 1  # replicas of this layout (the ranks above are one replica's)
    num_experts: int = 0  # a mixture of experts' routed experts per MoE layer (0: dense)

    @property
    def weight_line(self) -> str:
        """ "weights: 0.09 GiB per GPU (Q4_1 GGUF)": the most any GPU holds."""
        return f"weights: {self.per_gpu_weight_gib:.2f} GiB per GPU ({self.weight_format})"

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.kv_cache_tokens / self.max_model_len

    @property
    def total_kv_cache_tokens(self) -> int:
        return self.kv_cache_tokens * self.data_parallel_size

    @property
    def total_max_concurrency(self) -> float:
        return self.max_concurrency * self.data_parallel_size

    def replica_lines(self) -> list[str]:
        """KV tokens and concurrency per replica and in total (data parallel only)."""
        if self.data_parallel_size == 1:
            return []
        n = self.data_parallel_size
        return [
            f"Per replica: {self.kv_cache_tokens:,} KV tokens, maximum concurrency "
            f"{self.max_concurrency:.2f}x for {self.max_model_len:,} tokens per request",
            f"In total ({n} replicas, {n * self.gpus_used} GPUs): {self.total_kv_cache_tokens:,} "
            f"KV tokens, maximum concurrency {self.total_max_concurrency:.2f}x",
            *self.expert_parallel_lines(),
        ]

    def expert_parallel_lines(self) -> list[str]:
        """Data-parallel attention with expert-parallel MoE layers: the EP size and where the
        experts go (the weights above count each replica's ranks as if EP spanned TP only, an
        upper bound)."""
        if not (self.serve_args.get("enable_expert_parallel") and self.num_experts):
            return []
        from llmctl.engine.distributed.partition import describe_expert_placement

        n, tp = self.data_parallel_size, self.tensor_parallel_size
        ep = n * tp
        placement = describe_expert_placement(self.num_experts, ep).replace(" rank ", " EP rank ")
        return [
            f"Expert parallel across the replicas: EP size = DP x TP = {n} x {tp} = {ep} "
            f"({placement}; EP rank = dp_rank x {tp} + tp_rank); the replicas step together "
            "and one that fails stops them all"
        ]

    @property
    def per_gpu_weight_gib(self) -> float:
        return max(r.weight_bytes for r in self.ranks) / GIB

    @property
    def per_gpu_kv_cache_gib(self) -> float:
        return min(r.num_blocks * r.kv_block_bytes for r in self.ranks) / GIB

    def log_lines(self) -> list[str]:
        """The three lines the engine logs at start-up, as this plan predicts them."""
        where = "GPU " if self.device == "cuda" else ""
        return [
            f"# KV cache blocks: {self.num_kv_blocks} (block size {self.block_size})",
            f"{where}KV cache size: {self.kv_cache_tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x",
        ]

    def memory_lines(self) -> list[str]:
        """How the KV cache of the rank with the fewest blocks was estimated."""
        worst = min(self.ranks, key=lambda r: r.num_blocks)
        if self.device == "cpu":
            return [
                f"each rank's KV cache is --kv-cache-space-gib ({_gib(worst.kv_bytes, 2)}) "
                "exactly, as the engine allocates it"
            ]
        util, total = self.gpu_memory_utilization, self.gpu_memory_bytes
        nccl = f" + NCCL's buffers ({_gib(NCCL_BYTES, 2)})" if self.gpus_used > 1 else ""
        return [
            f"the engine gives the KV cache what is left of {util:g} x {_gib(total, 2)} = "
            f"{_gib(int(total * util), 2)} per GPU after its profile step (a forward of "
            f"{self.profile_num_tokens:,} tokens as {self.profile_num_sampled} requests, one "
            f"sampled token each); estimated here for rank {worst.rank}, the one with the "
            "fewest blocks:",
            f"weights {_gib(worst.weight_bytes, 2)}: its layers, embedding and LM head in "
            + (self.weight_format_detail or self.dtype),
            f"peak activations {_gib(worst.activation_bytes, 2)}: per token the residual, hidden "
            "states, QKV and MLP intermediates; then the sampled rows' logits, in float32 with "
            f"the sampler's temporaries ({SAMPLER_BYTES_PER_LOGIT} bytes per vocabulary entry)",
            f"outside torch {_gib(worst.non_torch_bytes, 2)}: the CUDA context "
            f"({_gib(CUDA_CONTEXT_BYTES, 2)}){nccl}, a constant; the engine measures its own",
            f"KV cache {_gib(worst.kv_bytes, 2)}: {worst.num_blocks:,} blocks of "
            f"{worst.kv_block_bytes:,} bytes",
        ]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "nodes_used": self.nodes_used,
            "gpus_used": self.gpus_used,
            "layer_partition": list(self.layer_partition),
            "per_gpu_weight_gib": round(self.per_gpu_weight_gib, 4),
            "per_gpu_kv_cache_gib": round(self.per_gpu_kv_cache_gib, 4),
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_concurrency": round(self.max_concurrency, 2),
            "data_parallel_size": self.data_parallel_size,
            "total_kv_cache_tokens": self.total_kv_cache_tokens,
            "total_max_concurrency": round(self.total_max_concurrency, 2),
            "distributed_executor_backend": self.distributed_executor_backend,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "weight_format": self.weight_format,
            "kv_cache_dtype": self.kv_cache_dtype,
            "device": self.device,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "profile_num_tokens": self.profile_num_tokens,
            "profile_num_sampled": self.profile_num_sampled,
            "memory": self.memory_lines(),
            "reasons": list(self.reasons),
            "rejected": [{"layout": layout, "why": why} for layout, why in self.rejected],
            "alternatives": [{"layout": lay, "offers": why} for lay, why in self.alternatives],
            "ranks": [r.__dict__ | {"layers": list(r.layers)} for r in self.ranks],
            "commands": dict(self.commands),
        }


# -- the memory model --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
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


def _resolve(spec: ModelSpec, inventory: Inventory, options: PlanOptions) -> _Ctx:
    from llmctl.engine.platform import resolve_dtype

    dtype = resolve_dtype(normalize_dtype(options.dtype), options.device, _ckpt(spec.dtype))
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = _KV_DTYPES[options.kv_cache_dtype] or dtype_bytes
    dense = dense_format(dtype, dtype_bytes)
    if spec.prequantized:
        if options.quantization is not None:
            raise ConfigError(
                f"{spec.name} is already quantized ({spec.weight_formats.label()}); "
                f"--quantization {options.quantization} quantizes float checkpoints",
                "drop --quantization: the GGUF's own types are served as they are",
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
    return _Ctx(
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
    )


def _ckpt(dtype: str) -> str | None:
    try:
        return normalize_dtype(dtype)
    except ConfigError:
        return None


def _rank_memory(ctx: _Ctx, tp: int, pp: int, parts: list[int]) -> list[RankMemory]:
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
            block = shape.kv_cache_bytes_per_block(
                layers, tp_rank, tp, ctx.kv_bytes, opts.block_size
            )
            if opts.device == "cpu":
                # The engine's own arithmetic: the KV budget over this rank's block bytes.
                activation = non_torch = 0
                num_blocks = cpu_num_gpu_blocks(opts.kv_cache_space_gib, block)
                kv = int((opts.kv_cache_space_gib or DEFAULT_CPU_KV_CACHE_SPACE_GIB) * GIB)
            else:
                activation = _activation_bytes(ctx, tp_rank, tp, last)
                non_torch = estimate_non_torch_bytes(tp * pp)
                profile = MemoryProfile(
                    total_bytes=_gpu_bytes(ctx),
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


def _gpu_bytes(ctx: _Ctx) -> int:
    return int(ctx.gpu_gib * GIB)


def _activation_bytes(ctx: _Ctx, tp_rank: int, tp: int, is_last_stage: bool) -> int:
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
        gated_mlp=shape.family == "llama",
        is_last_stage=is_last_stage,
        samples=is_last_stage and tp_rank == 0,
    )


@dataclass(frozen=True)
class _Eval:
    tp: int
    pp: int
    parts: tuple[int, ...]
    ranks: tuple[RankMemory, ...]
    default_parts: bool

    @property
    def blocks(self) -> int:
        return min(r.num_blocks for r in self.ranks)

    def fits(self, ctx: _Ctx) -> bool:
        needed = ctx.max_model_len * ctx.options.min_concurrency
        return self.blocks * ctx.options.block_size >= needed


def _evaluate(ctx: _Ctx, tp: int, pp: int, explicit: tuple[int, ...] | None = None) -> _Eval:
    default = layer_partition(ctx.spec.num_layers, pp)
    parts = list(layer_partition(ctx.spec.num_layers, pp, explicit)) if explicit else default
    ranks = _rank_memory(ctx, tp, pp, parts)
    evaluation = _Eval(tp, pp, tuple(parts), tuple(ranks), list(parts) == default)
    if pp > 1 and explicit is None:
        balanced = _balanced_partition(ctx, tp, pp)
        if balanced is not None and balanced != default:
            candidate = _rank_memory(ctx, tp, pp, balanced)
            if min(r.num_blocks for r in candidate) > evaluation.blocks:
                evaluation = _Eval(tp, pp, tuple(balanced), tuple(candidate), False)
    return evaluation


def _balanced_partition(ctx: _Ctx, tp: int, pp: int) -> list[int] | None:
    """The layer split that maximizes the smallest stage's KV blocks.

    A stage with L layers on tensor-parallel rank t holds B blocks when
        usable - activation_t - reserve - fixed_s,t - L * layer_t >= B * L * block_t
    (fixed: the embedding on the first stage, norm and LM head on the last). So at a target B a
    stage can take at most L_s(B) layers; binary search the largest B whose L_s(B) cover the model.
    """
    if ctx.options.device == "cpu":
        return None  # the KV budget is per rank, independent of the weights
    spec, shape, opts = ctx.spec, ctx.spec.shape, ctx.options
    usable = int(_gpu_bytes(ctx) * opts.gpu_memory_utilization)
    non_torch = estimate_non_torch_bytes(tp * pp)
    stages = []  # per stage: [(room, layer_bytes, block_bytes_per_layer) per tp rank]
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        per_rank = []
        for t in range(tp):
            fixed = ctx.weights.rank_bytes(shape, (0, 0), t, tp, is_first=first, is_last=last)
            room = usable - _activation_bytes(ctx, t, tp, last) - non_torch - fixed
            layer_bytes = ctx.weights.max_layer_bytes(shape, t, tp, opts.enable_expert_parallel)
            block = shape.kv_cache_bytes_per_block(1, t, tp, ctx.kv_bytes, opts.block_size)
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


# -- choosing ----------------------------------------------------------------------------------


def _layout(tp: int, pp: int) -> str:
    return f"tp={tp}, pp={pp}"


def _even_tp(spec: ModelSpec, tp: int) -> bool:
    """vLLM's condition: tp divides the heads, and divides or is a multiple of the KV heads."""
    kv = spec.num_kv_heads
    return spec.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def _uneven_tp(spec: ModelSpec, tp: int) -> bool:
    """A tp our engine runs (whole KV-head groups per rank, as evenly as possible) but vLLM,
    which needs tp to divide the heads, does not."""
    return not _even_tp(spec, tp) and tp in valid_tp_sizes(spec.num_heads, spec.num_kv_heads)


def _llmctl_only(tp: int, pp: int = 1) -> str:
    return f"{_layout(tp, pp)} (llmctl only)"


def _uneven_split(spec: ModelSpec, tp: int) -> str:
    """How the uneven ranks share the heads: "KV heads 3,3,2 (query heads 12,12,8) per rank"."""
    shards = spec.shape.tensor_parallel_heads(tp)
    kv = ",".join(str(s.num_kv_heads) for s in shards)
    q = ",".join(str(s.num_q_heads) for s in shards)
    return (
        f"uneven tensor parallel: KV heads {kv} (query heads {q}) per rank, whole KV-head groups "
        f"on each; vLLM cannot run it, since tp={tp} does not divide {spec.num_heads} heads "
        f"({spec.num_kv_heads} KV)"
    )


def _uneven_offer(ctx: _Ctx, spec: ModelSpec, tp: int, evaluation: _Eval, flag: bool) -> tuple:
    held = evaluation.blocks * ctx.options.block_size
    offer = f"{_uneven_split(spec, tp)}; holds {held:,} KV tokens"
    if flag:
        offer += "; --allow-uneven-tp lets the planner choose it"
    return _llmctl_only(tp), offer


def _gib(n: float, digits: int = 1) -> str:
    return f"{n / GIB:.{digits}f} GiB"


def make_plan(spec: ModelSpec, inventory: Inventory, options: PlanOptions | None = None) -> Plan:
    """The layout for `spec` on `inventory`, with its data-parallel replicas: those asked (one
    replica planned on the node's GPUs / N), or as many as one node holds. See _replica_plan."""
    options = options or PlanOptions()
    dp = options.data_parallel_size
    if dp is not None and dp > 1:
        return _asked_replicas(spec, inventory, options, dp)
    plan = _replica_plan(spec, inventory, options)
    asked = options.tensor_parallel_size or options.pipeline_parallel_size
    if dp is not None or asked or plan.device == "cpu" or plan.nodes_used > 1:
        return plan  # an asked layout is evaluated as asked: replicas only with -dp
    gpus_per_node = min(n.gpus for n in inventory.nodes if n.gpus)
    per_node = gpus_per_node // plan.gpus_used
    nodes = _gpu_nodes(inventory)
    replicas = per_node * len(nodes)
    if replicas < 2 or _shared_experts_error(plan, replicas, len(nodes) > 1) is not None:
        return plan  # (replicas sharing their experts only where they can)
    where = f"{plan.gpus_used} GPUs" if plan.gpus_used > 1 else "one GPU"
    if len(nodes) == 1:
        reason = (
            f"fits {where} of a node of {gpus_per_node}: {replicas} data-parallel replicas "
            f"(--data-parallel-size {replicas}), each its own engine and KV cache, serve about "
            f"{replicas}x the requests of one"
        )
        return _with_replicas(plan, replicas, reason)
    reason = (
        f"fits {where} of a node of {gpus_per_node}: {replicas} data-parallel replicas, "
        f"{per_node} on each of {len(nodes)} nodes (--data-parallel-size {replicas} "
        f"--data-parallel-size-local {per_node}), each its own engine and KV cache, serve about "
        f"{replicas}x the requests of one; node 0 serves the API, the others join it headless"
    )
    return _across_nodes(plan, nodes, per_node, reason)


def _gpu_nodes(inventory: Inventory) -> list:
    """The nodes with GPUs, the head first (it runs the API server and the router)."""
    nodes = [n for n in inventory.nodes if n.gpus]
    return sorted(nodes, key=lambda n: not n.head)


def _across_nodes(plan: Plan, nodes: list, per_node: int, reason: str) -> Plan:
    """`per_node` replicas on each of `nodes`: one serve command per node, as vLLM's multi-node
    data parallel runs them (the head's address and RPC port on every node's command)."""
    from llmctl.engine.dp.placement import DEFAULT_RPC_PORT

    replicas = per_node * len(nodes)
    plan = _with_replicas(plan, replicas, reason, across_nodes=True)
    one = plan.commands["serve"]  # a layout of one node: no -i, each node starts its own
    base = {
        "data_parallel_size_local": per_node,
        "data_parallel_address": nodes[0].ip,
        "data_parallel_rpc_port": DEFAULT_RPC_PORT,
    }
    commands = {k: v for k, v in plan.commands.items() if k != "serve"}
    commands["serve"] = f"{one} {' '.join(engine_args_to_argv(base))}  # on {nodes[0].host}"
    for i, node in enumerate(nodes[1:], start=1):
        extra = {**base, "data_parallel_start_rank": i * per_node, "headless": True}
        commands[f"serve_node_{i}"] = (
            f"{one} {' '.join(engine_args_to_argv(extra))}  # on {node.host}"
        )
    return dataclasses.replace(plan, commands=commands)


def _asked_replicas(spec: ModelSpec, inventory: Inventory, options: PlanOptions, dp: int) -> Plan:
    """--data-parallel-size N: one replica planned on a node's GPUs / N; typed errors naming the
    fix when the node cannot hold N replicas or one replica does not fit its share."""
    if options.device == "cpu":
        plan = _replica_plan(spec, inventory, options)
        return _with_replicas(plan, dp, f"{dp} data-parallel replicas as asked")
    per_node = min((n.gpus for n in inventory.nodes if n.gpus), default=0)
    nodes = _gpu_nodes(inventory)
    tp, pp = options.tensor_parallel_size or 1, options.pipeline_parallel_size or 1
    asked = tp * pp
    # replicas that share their experts stay on one node when it holds them
    shared = options.enable_expert_parallel and spec.num_experts and per_node >= dp * asked
    if len(nodes) > 1 and not shared and (dp % len(nodes) == 0 or per_node < dp * asked):
        # spread over the nodes: N / nodes replicas each, none left idle
        return _asked_across_nodes(spec, inventory, options, dp, nodes, per_node)
    if per_node < dp * asked:
        fewer = per_node // asked
        layout = f" of {_layout(tp, pp)}" if asked > 1 else ""
        raise ConfigError(
            f"data_parallel_size={dp} replicas{layout} need {dp * asked} GPUs on one node, but "
            f"a node of this inventory has {per_node}",
            (f"use --data-parallel-size {fewer} or fewer" if fewer else "use fewer GPUs per "
             "replica (-tp/-pp)") + ", or add nodes to the inventory",
        )  # fmt: skip
    head = nodes[0] if nodes else inventory.nodes[0]

    def on_share(k: int) -> Plan:
        """One replica planned on a node's GPUs / k."""
        node = dataclasses.replace(head, head=True, gpus=per_node // k)
        return _replica_plan(spec, dataclasses.replace(inventory, nodes=(node,)), options)

    share = per_node // dp
    try:
        plan = on_share(dp)
    except PlanError as too_big:
        fewer = next((k for k in range(dp - 1, 1, -1) if _fits(on_share, k)), None)
        fix = (
            f"use --data-parallel-size {fewer} or fewer"
            if fewer
            else "drop --data-parallel-size: one replica needs more than a node's GPUs"
        )
        raise PlanError(
            f"data_parallel_size={dp}: one replica gets {share} of a node's {per_node} GPUs, "
            f"and {too_big.message}",
            f"{fix}; {too_big.hint}",
        ) from None
    reason = (
        f"{dp} data-parallel replicas as asked, each on {share} of a node's {per_node} GPUs "
        f"(its layout chosen for those {share}); each its own engine and KV cache"
    )
    return _with_replicas(plan, dp, reason)


def _asked_across_nodes(
    spec: ModelSpec, inventory: Inventory, options: PlanOptions, dp: int, nodes: list, per_node: int
) -> Plan:
    """--data-parallel-size N on several GPU nodes: N / nodes replicas on each node (N a multiple
    of the node count), each planned on a node's GPUs / (N / nodes)."""
    tp, pp = options.tensor_parallel_size or 1, options.pipeline_parallel_size or 1
    asked = tp * pp
    capacity = (per_node // asked) * len(nodes)
    if dp % len(nodes) or dp > capacity:
        fits = [k for k in range(len(nodes), capacity + 1, len(nodes))]
        layout = f" of {_layout(tp, pp)}" if asked > 1 else ""
        raise ConfigError(
            f"data_parallel_size={dp} replicas{layout} do not divide evenly over this "
            f"inventory's {len(nodes)} nodes of {per_node} GPUs"
            if dp <= capacity
            else f"data_parallel_size={dp} replicas{layout} need {dp * asked} GPUs, but this "
            f"inventory's {len(nodes)} nodes have {per_node * len(nodes)}",
            f"use --data-parallel-size {' or '.join(map(str, fits))}"
            if fits
            else "use fewer GPUs per replica (-tp/-pp)",
        )
    local = dp // len(nodes)
    node = dataclasses.replace(nodes[0], head=True, gpus=per_node // local)
    try:
        plan = _replica_plan(spec, dataclasses.replace(inventory, nodes=(node,)), options)
    except PlanError as too_big:
        fix = (
            "drop --data-parallel-size: one replica needs more than a node's GPUs"
            if local == 1
            else f"use --data-parallel-size {len(nodes)}"
        )
        raise PlanError(
            f"data_parallel_size={dp}: one replica gets {per_node // local} of a node's "
            f"{per_node} GPUs, and {too_big.message}",
            f"{fix}; {too_big.hint}",
        ) from None
    reason = (
        f"{dp} data-parallel replicas as asked, {local} on each of {len(nodes)} nodes (each on "
        f"{per_node // local} of a node's {per_node} GPUs); node 0 serves the API, the others "
        "join it headless"
    )
    return _across_nodes(plan, nodes, local, reason)


def _fits(plan_for, k: int) -> bool:
    try:
        plan_for(k)
    except (PlanError, ConfigError):
        return False
    return True


def _shared_experts_error(plan: Plan, replicas: int, across_nodes: bool) -> ConfigError | None:
    """Why `replicas` of `plan` cannot run with --enable-expert-parallel (their MoE layers then
    share the experts over DP x TP ranks: engine/dp/lockstep.py), or None when they can (or do
    not share them)."""
    from llmctl.engine.distributed.partition import expert_shards

    if replicas < 2 or not (plan.serve_args.get("enable_expert_parallel") and plan.num_experts):
        return None
    try:
        ParallelConfig(
            tensor_parallel_size=plan.tensor_parallel_size,
            pipeline_parallel_size=plan.pipeline_parallel_size,
            enable_expert_parallel=True,
            data_parallel_size=replicas,
        )
        expert_shards(plan.num_experts, replicas * plan.tensor_parallel_size)
    except ConfigError as exc:
        return exc
    if across_nodes:
        return ConfigError(
            f"--enable-expert-parallel with --data-parallel-size {replicas} runs every replica "
            "on one node (their MoE layers share the experts); replicas on several nodes are "
            "not supported with it yet",
            "use --data-parallel-size that fits one node, or drop --enable-expert-parallel to "
            "run independent replicas across nodes",
        )
    return None


def _with_replicas(plan: Plan, replicas: int, reason: str, across_nodes: bool = False) -> Plan:
    """The plan of one replica, served as `replicas` (the serve command with its flag).
    Raises ConfigError when the replicas cannot share their experts as asked."""
    error = _shared_experts_error(plan, replicas, across_nodes)
    if error is not None:
        raise error
    serve = (
        plan.commands["serve"]
        + " "
        + " ".join(engine_args_to_argv({"data_parallel_size": replicas}))
    )
    return dataclasses.replace(
        plan,
        data_parallel_size=replicas,
        # each replica its own worker processes, one per rank (engine/executor/base.py)
        distributed_executor_backend="mp"
        if plan.distributed_executor_backend == "uni"
        else plan.distributed_executor_backend,
        reasons=(*plan.reasons, reason),
        commands={**plan.commands, "serve": serve},
    )


def _replica_plan(spec: ModelSpec, inventory: Inventory, options: PlanOptions) -> Plan:
    """The layout of one engine on `inventory`. A float checkpoint too big for the inventory gets
    the layout of its weight-only quantization instead (int8, else int4), its reasons saying so
    and its serve command carrying --quantization; PlanError when even int4 does not fit."""
    try:
        return _choose(spec, inventory, options)
    except PlanError as too_big:
        if options.device == "cpu" or spec.prequantized:
            raise
        schemes = list(QUANTIZATION_SCHEMES)  # the largest first
        smaller = schemes[schemes.index(options.quantization) + 1 :] if options.quantization else []
        for scheme in smaller if options.quantization else schemes:
            try:
                plan = _choose(spec, inventory, dataclasses.replace(options, quantization=scheme))
            except (PlanError, ConfigError):
                continue
            if options.quantization:  # asked for: proposed, not chosen
                layout = _layout(plan.tensor_parallel_size, plan.pipeline_parallel_size)
                hint = f"{too_big.hint}; --quantization {scheme} fits ({layout})"
                raise PlanError(too_big.message, hint) from None
            return _quantized_instead(plan, too_big, spec, inventory, options)
        hint = f"{too_big.hint}; even --quantization {schemes[-1]} does not fit"
        raise PlanError(too_big.message, hint) from None


def _quantized_instead(
    plan: Plan, too_big: PlanError, spec: ModelSpec, inventory: Inventory, options: PlanOptions
) -> Plan:
    """The quantized plan, its first reasons saying why it is quantized; the smaller schemes
    that fit are offered next to it."""
    scheme = QUANTIZATION_SCHEMES[plan.quantization]
    reasons = (
        f"too big in {plan.dtype}: {too_big.message}",
        f"so weight-only {scheme.name} quantization (--quantization {scheme.name}): "
        f"{_scheme_text(scheme)}; the embedding and LM head in {plan.dtype}",
    )
    alternatives = list(plan.alternatives)
    schemes = list(QUANTIZATION_SCHEMES)
    for smaller in schemes[schemes.index(scheme.name) + 1 :]:
        try:
            other = _choose(spec, inventory, dataclasses.replace(options, quantization=smaller))
        except (PlanError, ConfigError):
            continue
        layout = _layout(other.tensor_parallel_size, other.pipeline_parallel_size)
        ratio = other.kv_cache_tokens / max(plan.kv_cache_tokens, 1)
        offer = (
            f"{_scheme_text(QUANTIZATION_SCHEMES[smaller])}: {other.gpus_used} GPU(s), "
            f"{ratio:.1f}x the KV cache"
        )
        alternatives.append((f"{layout} with --quantization {smaller}", offer))
    return dataclasses.replace(
        plan, reasons=reasons + plan.reasons, alternatives=tuple(alternatives)
    )


def _scheme_text(scheme) -> str:
    """ "the linear layers in 4-bit groups of 32 with their scales, 0.75 bytes per weight"."""
    return (
        f"the linear layers in {scheme.bits}-bit groups of {scheme.group_size} with their scales, "
        f"{scheme.format.bytes_per_weight:.4g} bytes per weight"
    )


def _choose(spec: ModelSpec, inventory: Inventory, options: PlanOptions) -> Plan:
    ctx = _resolve(spec, inventory, options)
    rejected: list[tuple[str, str]] = []
    alternatives: list[tuple[str, str]] = []
    if options.device == "cpu" or options.tensor_parallel_size or options.pipeline_parallel_size:
        tp, pp = options.tensor_parallel_size or 1, options.pipeline_parallel_size or 1
        valid = valid_tp_sizes(spec.num_heads, spec.num_kv_heads)
        if tp not in valid:
            raise ConfigError(
                f"tensor_parallel_size={tp} cannot split {spec.num_heads} attention heads "
                f"({spec.num_kv_heads} KV heads)",
                f"use one of {', '.join(map(str, valid))}",
            )
        ctx.weights.check_split(spec.shape, tp, valid)
        spec.shape.check_tensor_parallel(tp, options.enable_expert_parallel)
        chosen = _evaluate(ctx, tp, pp, options.pipeline_layer_partition)
        reasons = [f"{_layout(tp, pp)} as asked"]
        if _uneven_tp(spec, tp):
            reasons.append(f"llmctl only: {_uneven_split(spec, tp)}")
        if not chosen.fits(ctx):
            raise _too_big(ctx, [chosen], f"the asked layout {_layout(tp, pp)}")
        return _finish(ctx, chosen, reasons, rejected, alternatives)

    need = ctx.max_model_len * options.min_concurrency
    want = f"room for {options.min_concurrency} request(s) of {ctx.max_model_len:,} tokens"
    gpus, nodes = ctx.gpus_per_node, ctx.nodes
    pcie = any(n.interconnect == "pcie" for n in inventory.nodes if n.gpus)
    tried: list[_Eval] = []

    def attempt(tp: int, pp: int) -> _Eval | None:
        if pp > spec.num_layers:
            rejected.append((_layout(tp, pp), f"more stages than the {spec.num_layers} layers"))
            return None
        evaluation = _evaluate(ctx, tp, pp)
        tried.append(evaluation)
        if evaluation.fits(ctx):
            return evaluation
        held = evaluation.blocks * options.block_size
        rejected.append((_layout(tp, pp), f"holds {held:,} KV tokens, needs {need:,}"))
        return None

    def whole(tp: int) -> bool:
        """Quantized weights: every rank's row-parallel inputs are whole quantization groups."""
        return not ctx.weights.cut_groups(spec.shape, tp, options.enable_expert_parallel)

    def allowed(tp: int) -> bool:
        if options.enable_expert_parallel and tp > spec.num_experts:
            return False  # some rank would hold no expert
        return whole(tp) and (
            _even_tp(spec, tp)
            or (options.allow_uneven_tp and tp in valid_tp_sizes(spec.num_heads, spec.num_kv_heads))
        )

    def uneven_whole(tp: int) -> bool:
        return whole(tp) and _uneven_tp(spec, tp)

    # 1. One GPU.
    chosen = attempt(1, 1)
    if chosen is not None:
        reasons = [f"the model fits one GPU with {want}: no distributed inference needed"]
        if gpus > 1 and allowed(gpus):
            alternatives.append(_full_width(ctx, chosen, gpus))
        elif gpus > 1 and uneven_whole(gpus):
            layout, offer = _full_width(ctx, chosen, gpus)
            alternatives.append((_llmctl_only(gpus), f"{offer}; {_uneven_split(spec, gpus)}"))
        return _finish(ctx, chosen, reasons, rejected, alternatives)

    # 2. One node.
    if gpus > 1:
        if pcie:
            for k in range(2, gpus + 1):
                chosen = attempt(1, k)
                if chosen is not None:
                    reasons = [
                        f"too big for one GPU; fits {k} GPUs of one node with {want}",
                        "no NVLink (PCIe): pipeline stages inside the node, whose activations "
                        "cross the link once per stage instead of twice per layer",
                    ]
                    return _finish(ctx, chosen, reasons, rejected, alternatives)
        else:
            for tp in range(2, gpus + 1):
                cuts = ctx.weights.cut_groups(spec.shape, tp, options.enable_expert_parallel)
                if cuts:
                    rejected.append((_layout(tp, 1), f"cuts the quantization groups of {cuts[0]}"))
                    continue
                if not allowed(tp):
                    if _uneven_tp(spec, tp):
                        uneven = _evaluate(ctx, tp, 1)
                        if uneven.fits(ctx):
                            # What our engine can do and vLLM cannot, offered next to the
                            # vLLM-compatible layout chosen below.
                            alternatives.append(_uneven_offer(ctx, spec, tp, uneven, True))
                            chosen = attempt(1, tp)
                            if chosen is not None:
                                reasons = [
                                    f"too big for one GPU; {tp} GPUs hold it, but tp={tp} does "
                                    f"not divide {spec.num_heads} heads ({spec.num_kv_heads} KV)",
                                    f"so pipeline parallel over {tp} GPUs (tp=1, pp={tp}), which "
                                    "splits layers unevenly (--allow-uneven-tp would use tp)",
                                ]
                                return _finish(ctx, chosen, reasons, rejected, alternatives)
                            continue
                        held = uneven.blocks * options.block_size
                        why = f"uneven tensor parallel holds {held:,} KV tokens, needs {need:,}"
                        rejected.append((_llmctl_only(tp), why))
                        continue
                    rejected.append(
                        (_layout(tp, 1), f"tp={tp} does not divide {spec.num_heads} heads")
                    )
                    continue
                chosen = attempt(tp, 1)
                if chosen is not None:
                    reasons = [
                        f"too big for one GPU; fits one node with tensor parallel over {tp} "
                        f"GPUs with {want}",
                        f"tp={tp} is the smallest tensor-parallel size that fits",
                    ]
                    if _uneven_tp(spec, tp):
                        reasons.append(f"llmctl only: {_uneven_split(spec, tp)}")
                    if tp < gpus and allowed(gpus):
                        alternatives.append(_full_width(ctx, chosen, gpus))
                    elif tp < gpus and uneven_whole(gpus):
                        layout, offer = _full_width(ctx, chosen, gpus)
                        offer = f"{offer}; {_uneven_split(spec, gpus)}"
                        alternatives.append((_llmctl_only(gpus), offer))
                    return _finish(ctx, chosen, reasons, rejected, alternatives)

    # 3. Across nodes: tp = GPUs per node, pp = nodes used.
    tp = max((t for t in range(1, gpus + 1) if allowed(t)), default=1)
    for n in range(2, nodes + 1):
        chosen = attempt(tp, n)
        if chosen is not None:
            reasons = [
                f"too big for one node; fits {n} nodes with {want}",
                f"tensor parallel inside each node (tp={tp}"
                + ("" if tp == gpus else f", the largest size <= {gpus} that divides the heads")
                + f"), pipeline parallel across the {n} nodes (pp={n})",
            ]
            if tp < gpus and uneven_whole(gpus):
                wider = _evaluate(ctx, gpus, n)
                if wider.fits(ctx):
                    ratio = wider.blocks / max(chosen.blocks, 1)
                    offer = f"every GPU of the {n} nodes: {ratio:.1f}x the KV cache"
                    alternatives.append(
                        (_llmctl_only(gpus, n), f"{offer}; {_uneven_split(spec, gpus)}")
                    )
            return _finish(ctx, chosen, reasons, rejected, alternatives)
    raise _too_big(ctx, tried, f"{nodes} node(s) x {gpus} GPU(s) of {ctx.gpu_gib:g} GiB")


def _full_width(ctx: _Ctx, chosen: _Eval, gpus: int) -> tuple[str, str]:
    """The throughput option: tensor parallel over the whole node."""
    ratio = _evaluate(ctx, gpus, 1).blocks / max(chosen.blocks, 1)
    return _layout(gpus, 1), f"the node's full width: {ratio:.1f}x the KV cache, for throughput"


def _finish(ctx: _Ctx, chosen: _Eval, reasons, rejected, alternatives) -> Plan:
    spec, opts = ctx.spec, ctx.options
    tp, pp = chosen.tp, chosen.pp
    world = tp * pp
    if opts.device == "cpu":
        nodes_used = 1
    else:
        nodes_used = math.ceil(world / ctx.gpus_per_node) if world > ctx.gpus_per_node else 1
    backend = "uni" if world == 1 else ("ray" if nodes_used > 1 else "mp")
    reasons = list(reasons)
    if not chosen.default_parts:
        reasons.append(
            f"uneven layer split {','.join(map(str, chosen.parts))}: the first and last stages "
            "also hold the embedding and the LM head, so they take fewer layers and every stage "
            "keeps about the same room for KV cache"
        )
    blocks = chosen.blocks
    worst = min(chosen.ranks, key=lambda r: r.num_blocks)
    reasons.append(
        f"the KV cache has {blocks:,} blocks: as many as rank {worst.rank} (the fewest) holds"
    )
    # `llmctl serve`: the layout, then the options the prediction depends on where they differ
    # from the engine's defaults, spelled as EngineArgs declares them.
    defaults = PlanOptions()
    cpu = opts.device == "cpu"
    layout = {
        "tensor_parallel_size": tp if tp > 1 else None,
        "pipeline_parallel_size": pp if pp > 1 else None,
        "distributed_executor_backend": backend if world > 1 else None,
        "pipeline_layer_partition": None if chosen.default_parts else chosen.parts,
    }
    engine = {
        "dtype": ctx.dtype if opts.dtype != "auto" else None,
        "max_model_len": (
            ctx.max_model_len if ctx.max_model_len != spec.max_position_embeddings else None
        ),
        "device": "cpu" if cpu else None,
        "kv_cache_space_gib": opts.kv_cache_space_gib if cpu else None,
        "gpu_memory_utilization": (
            opts.gpu_memory_utilization
            if not cpu and opts.gpu_memory_utilization != defaults.gpu_memory_utilization
            else None
        ),
        "block_size": opts.block_size if opts.block_size != defaults.block_size else None,
        "max_num_seqs": opts.max_num_seqs if opts.max_num_seqs != defaults.max_num_seqs else None,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "quantization": opts.quantization,
        "enable_expert_parallel": opts.enable_expert_parallel or None,
    }
    serve = ["llmctl", "serve", spec.name, *engine_args_to_argv(layout, aliases=True)]
    serve += engine_args_to_argv(engine)
    commands = {"serve": " ".join(serve)}
    if nodes_used > 1:
        source = ctx.inventory.source if ctx.inventory.source != "<flags>" else "cluster.yaml"
        commands["cluster_up"] = f"llmctl cluster up -i {source}"
        commands["serve"] = " ".join(serve[:2] + ["-i", source] + serve[2:])
    return Plan(
        device=opts.device,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        gpu_memory_bytes=_gpu_bytes(ctx),
        profile_num_tokens=ctx.num_tokens,
        profile_num_sampled=ctx.num_sampled,
        model=spec.name,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        nodes_used=nodes_used,
        gpus_used=world,
        layer_partition=chosen.parts,
        default_partition=chosen.default_parts,
        distributed_executor_backend=backend,
        dtype=ctx.dtype,
        kv_cache_dtype=opts.kv_cache_dtype,
        block_size=opts.block_size,
        max_model_len=ctx.max_model_len,
        num_kv_blocks=blocks,
        ranks=chosen.ranks,
        reasons=tuple(reasons),
        rejected=tuple(rejected),
        alternatives=tuple(alternatives),
        commands=commands,
        serve_args={**layout, **engine},
        quantization=opts.quantization,
        weight_format=ctx.weights.label(),
        weight_format_detail=ctx.weights.detail(spec.shape) if ctx.weights.quantized else "",
        num_experts=spec.shape.num_experts or 0,
    )


def _too_big(ctx: _Ctx, tried: list[_Eval], what: str) -> PlanError:
    """How much memory is missing, and what would fit instead."""
    spec, opts = ctx.spec, ctx.options
    need_tokens = ctx.max_model_len * opts.min_concurrency
    weights = ctx.weights.rank_bytes(
        spec.shape, (0, spec.num_layers), 0, 1, is_first=True, is_last=True
    )
    kv = need_tokens * spec.shape.kv_bytes_per_token(spec.num_layers, 0, 1, ctx.kv_bytes)
    if opts.device == "cpu":
        best = max(tried, key=lambda e: e.blocks) if tried else None
        held = best.blocks * opts.block_size if best else 0
        return PlanError(
            f"the KV cache of {opts.kv_cache_space_gib} GiB per rank holds {held:,} tokens; "
            f"{need_tokens:,} are needed ({opts.min_concurrency} x {ctx.max_model_len:,})",
            "raise --kv-cache-space-gib, or lower --max-model-len or --min-concurrency",
        )
    gpus_total = ctx.gpus_per_node * ctx.nodes
    usable = _gpu_bytes(ctx) * opts.gpu_memory_utilization
    per_gpu_overhead = _activation_bytes(ctx, 0, 1, True) + estimate_non_torch_bytes(gpus_total)
    needed = weights + kv + per_gpu_overhead * gpus_total
    available = usable * gpus_total
    missing = max(needed - available, 0)
    hints = []
    room = usable - per_gpu_overhead
    if room > 0:
        hints.append(f"about {math.ceil((weights + kv) / room)} GPUs of {ctx.gpu_gib:g} GiB")
    shorter = _longest_fitting_len(ctx, tried)
    if shorter:
        hints.append(f"--max-model-len {shorter}")
    message = (
        f"{spec.name} does not fit {what} with room for {opts.min_concurrency} request(s) of "
        f"{ctx.max_model_len:,} tokens: weights {_gib(weights)} ({ctx.weights.label()}) + "
        f"KV cache {_gib(kv)} + activations and memory outside torch "
        f"{_gib(per_gpu_overhead)} per GPU"
    )
    if missing:
        message += f"; {_gib(missing)} more memory is needed"
    return PlanError(message, "what would fit: " + ("; ".join(hints) or "a larger inventory"))


def _longest_fitting_len(ctx: _Ctx, tried: list[_Eval]) -> int | None:
    best = max((e.blocks for e in tried), default=0)
    tokens = best * ctx.options.block_size // ctx.options.min_concurrency
    return tokens if 0 < tokens < ctx.max_model_len else None
