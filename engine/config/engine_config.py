"""Engine configuration: one frozen dataclass per layer, validated once in __post_init__.

`EngineArgs` (engine/config/engine_args.py, importable from here too) holds what a user passes
(LLM(...) keywords, CLI flags); its `create_engine_config()` resolves it into these frozen configs.
Per-rank variants are made with `dataclasses.replace`.
This module reads files (the model's config) but never imports torch at module level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.engine.config.kv_cache_layout import KVCacheLayout
from llmctl.engine.config.memory_profile import check_gpu_memory_utilization
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError, KVCacheTooSmallError
from llmctl.engine.layers.quantization.quant_config import QuantizationConfig

# Names accepted for --dtype, and what they mean.
_DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DEVICES = ("auto", "cpu", "cuda")


def normalize_dtype(dtype: str) -> str:
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ConfigError(
            f"unknown dtype {dtype!r}",
            "use one of auto, float32, bfloat16, float16 (aliases: float, half, bf16, fp16, fp32)",
        )
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class ModelConfig:
    """The model to run: where it is, its Hugging Face config and the ModelShape read from it
    (what the engine's sizes come from), and the dtype and length to use."""

    model: str  # what the user named (a path, or "" for the bundled default)
    path: str  # local directory holding config.json and the weights
    hf_config: Any = field(compare=False, repr=False)
    architecture: str = ""
    dtype: str = "float32"  # resolved: float32, bfloat16 or float16
    max_model_len: int = 0
    tokenizer: str = ""  # directory to load the tokenizer from (defaults to path)
    served_model_name: str = ""
    seed: int = 0
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs have no text
    enforce_eager: bool = False  # CUDA: no CUDA graphs, every step runs eagerly (as vLLM's flag)
    shape: ModelShape | None = None  # None: read from hf_config
    # How the linear weights are stored: None float; "gguf" the GGUF file's own blocks;
    # "int8"/"int4" quantized from a float checkpoint at load.
    quantization: QuantizationConfig | None = None
    gguf_file: str = ""  # the weights are read from this GGUF file (path holds its config only)
    load_format: str = "auto"  # "dummy": random weights, no checkpoint read (model_loader/dummy.py)
    # CPU: 4-bit packed weights multiply float32 batches (64 rows or more) by int8
    # activations (the AVX2 path under dtype "auto": platform.int8_activations; an explicit
    # dtype="float32" keeps the float path's numerics)
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.shape is None:
            arch = self.architecture or None
            object.__setattr__(self, "shape", ModelShape.from_hf_config(self.hf_config, arch))
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be resolved, got {self.dtype!r}")
        if self.max_model_len < 1:
            raise ConfigError(
                f"max_model_len must be at least 1, got {self.max_model_len}",
                "pass a positive --max-model-len",
            )

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.shape.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.shape.num_kv_heads

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = 16
    kv_cache_space_gib: float | None = None  # CPU: bytes for the cache (None: 4 GiB)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # fixes the block count (--num-gpu-blocks-override)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"block_size must be a positive power of two, got {self.block_size}",
                "use 16 (the default), 8 or 32",
            )
        if self.kv_cache_space_gib is not None and self.kv_cache_space_gib <= 0:
            raise ConfigError(
                f"kv_cache_space_gib must be positive, got {self.kv_cache_space_gib}",
                "give the KV cache some memory, e.g. --kv-cache-space-gib 4",
            )
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(
                f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: requests per step and tokens per step (chunked prefill)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 8192
    # Batches in flight at once (pipeline parallelism): running requests are split into this
    # many batches so that every pipeline stage has work.
    max_concurrent_batches: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(
                f"max_num_seqs must be at least 1, got {self.max_num_seqs}",
                "allow at least one running request",
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
                "allow a positive token budget per step",
            )
        if self.max_concurrent_batches < 1:
            raise ConfigError(
                f"max_concurrent_batches must be at least 1, got {self.max_concurrent_batches}",
                "use 1 to disable pipelining of batches, or the number of pipeline stages",
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor parallel ranks x pipeline parallel stages."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # uni, mp, ray; None: chosen automatically
    pipeline_layer_partition: tuple[int, ...] | None = None
    # MoE layers hold whole experts per rank of the TP group instead of a slice of each (with
    # data_parallel_size > 1: per rank of every replica, see expert_parallel_across_dp).
    enable_expert_parallel: bool = False
    # Data parallel: independent engine replicas of tp x pp ranks each (engine/dp/dp_async_llm.py);
    # data_parallel_rank is the replica's index (set per replica with dataclasses.replace).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # With enable_expert_parallel and data_parallel_size > 1 the replicas' workers form one
    # torch.distributed world (DP attention + EP MoE): its rendezvous port on this node, chosen
    # once for every replica (engine/dp/dp_async_llm.py).
    data_parallel_master_port: int = 0
    # Rank of this process (set per worker with dataclasses.replace).
    rank: int = 0
    # Ray: the group whose bundle i hosts rank i (as vLLM's); None: the executor makes one.
    placement_group: Any = field(default=None, compare=False, repr=False)
    # The mp backend across nodes (vLLM's --nnodes): node r runs the global ranks
    # ranks.node_ranks(r, ...); node 0 hosts the rendezvous at master_addr:master_port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29501
    rendezvous_timeout: float = 300.0  # seconds the nodes wait for each other
    # How nodes prove they belong to the cluster when they join (engine/distributed/join.py):
    # the secret's file (None: LLMCTL_CLUSTER_SECRET), or no proof at all. The secret itself is
    # never a field: configs travel to the workers, each node reads its own.
    cluster_secret_file: str | None = None
    insecure_join: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"unknown distributed_executor_backend {backend!r}",
                f"use one of {', '.join(EXECUTOR_BACKENDS)}",
            )
        if backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"the uni backend runs one process, but tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size}",
                "use --distributed-executor-backend mp or ray",
            )
        if self.data_parallel_size > 1 and backend == "uni":
            raise ConfigError(
                f"data_parallel_size={self.data_parallel_size} runs each replica in its own "
                "worker processes; the uni backend cannot",
                "use --distributed-executor-backend mp (or ray), or leave it out",
            )

        if self.nnodes != 1 or self.node_rank != 0:
            from llmctl.engine.distributed.ranks import check_nodes

            check_nodes(self)
        if self.expert_parallel_across_dp:
            check_expert_parallel_across_dp(self)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def expert_parallel_across_dp(self) -> bool:
        """Data-parallel attention with expert-parallel MoE layers: the replicas share one
        world, and the experts are dealt over all of its ranks (EP size = DP x TP)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def world_size_across_dp(self) -> int:
        """Ranks in this worker's torch.distributed world: every replica's, when they share it."""
        return self.world_size * (self.data_parallel_size if self.expert_parallel_across_dp else 1)

    @property
    def global_rank_offset(self) -> int:
        """This replica's first rank in the shared world (0 when replicas do not share one)."""
        return self.world_size * self.data_parallel_rank if self.expert_parallel_across_dp else 0


def check_expert_parallel_across_dp(pc: ParallelConfig) -> None:
    """Refuse what data-parallel attention with expert-parallel MoE layers does not support
    (yet): pipeline stages, a backend other than mp, several nodes."""
    what = (
        f"--enable-expert-parallel with --data-parallel-size {pc.data_parallel_size} (the "
        "replicas share their MoE layers' experts)"
    )
    if pc.pipeline_parallel_size > 1:
        raise ConfigError(
            f"{what} does not support pipeline_parallel_size={pc.pipeline_parallel_size} yet",
            "drop --pipeline-parallel-size (use -tp within each replica), or drop "
            "--enable-expert-parallel to run independent replicas",
        )
    if pc.distributed_executor_backend not in (None, "mp"):
        raise ConfigError(
            f"{what} runs on the mp backend, not {pc.distributed_executor_backend!r}",
            "use --distributed-executor-backend mp, or leave it out",
        )
    if pc.nnodes > 1:
        raise ConfigError(
            f"{what} runs every replica on this node, not on {pc.nnodes} nodes",
            "drop --nnodes, or drop --enable-expert-parallel",
        )


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" or "cuda"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r}", "use cpu or cuda")


@dataclass(frozen=True)
class EngineConfig:
    # None: the executors start bare workers (no model), e.g. for `llmctl doctor`'s all-reduce.
    model_config: ModelConfig | None
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig


def resolve_max_num_batched_tokens(given: int | None, max_num_seqs: int) -> int:
    """The token budget per step (and the CUDA profile step's size): 8192, or max_num_seqs when
    larger, unless given."""
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs) if given is None else given


def parse_layer_partition(
    value: str | tuple[int, ...] | list[int] | None,
) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            parts = tuple(int(p) for p in value.split(","))
        except ValueError:
            raise ConfigError(
                f"pipeline_layer_partition {value!r} is not a comma-separated list of integers",
                'write the layers per stage, e.g. "10,11,9"',
            ) from None
    else:
        parts = tuple(int(p) for p in value)
    if any(p < 1 for p in parts):
        raise ConfigError(
            f"pipeline_layer_partition {value!r} gives a stage no layers",
            "every stage needs at least one layer",
        )
    return parts


def check_layout(
    shape: ModelShape,
    tp: int,
    pp: int,
    explicit: tuple[int, ...] | None,
    expert_parallel: bool = False,
) -> None:
    """Refuse a TP x PP (x EP) layout the model cannot take, before any worker starts."""
    from llmctl.engine.distributed.partition import layer_partition

    if expert_parallel:
        check_expert_parallel(shape)
    shape.check_tensor_parallel(tp, expert_parallel)
    layer_partition(shape.num_layers, pp, explicit)


def check_expert_parallel(shape: ModelShape) -> None:
    """Refuse expert parallelism on a dense model (the engine and the planner both ask)."""
    if not shape.num_experts:
        raise ConfigError(
            f"expert parallelism needs a mixture-of-experts model; {shape.architecture} has no "
            "experts",
            "drop --enable-expert-parallel (enable_expert_parallel=False): tensor parallelism "
            "splits a dense model's MLP",
        )


def checkpoint_dtype(hf_config: Any) -> str | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None:
        return None
    try:
        return normalize_dtype(str(value))
    except ConfigError:
        return None


def resolve_max_model_len(shape: ModelShape, requested: int | None) -> int:
    derived = shape.max_position_embeddings
    if requested is None:
        return derived
    if requested < 1:
        raise ConfigError(
            f"max_model_len must be at least 1, got {requested}", "pass a positive --max-model-len"
        )
    if requested > derived:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's maximum length of {derived} tokens",
            f"use --max-model-len {derived} or less",
        )
    return requested


def check_kv_cache_fits(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    knob: str,
    layout: KVCacheLayout | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> None:
    """Raise KVCacheTooSmallError when the cache cannot hold one max_model_len request (with
    `layout`: the blocks its KV cache groups hold at most, sliding windows counted)."""
    if layout is None or not any(layout.sliding_windows):
        tokens = num_blocks * block_size
        if tokens >= max_model_len:
            return
        raise KVCacheTooSmallError(
            f"the KV cache holds {tokens} tokens ({num_blocks} blocks of {block_size}), fewer "
            f"than one request of max_model_len={max_model_len} tokens",
            f"raise {knob}, or lower --max-model-len to {tokens} or less",
        )
    needed = layout.request_blocks(max_model_len, max_num_batched_tokens)
    if num_blocks >= needed:
        return
    raise KVCacheTooSmallError(
        f"the KV cache holds {num_blocks} blocks of {block_size}, fewer than the {needed} one "
        f"request of max_model_len={max_model_len} tokens needs in its {layout.num_groups} KV "
        "cache groups",
        f"raise {knob}, or lower --max-model-len",
    )
