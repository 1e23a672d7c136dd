"""Plan: a chosen layout with its per-rank memory, KV-cache prediction, reasons and the commands
that run it; RankMemory: one rank's bytes and blocks. Pure values with their rendering."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from llmctl.engine.config.memory_profile import (
    CUDA_CONTEXT_BYTES,
    GIB,
    NCCL_BYTES,
    SAMPLER_BYTES_PER_LOGIT,
)


@dataclass(frozen=True)
class RunStep:
    """One command of a plan's "Run" section: its argv, and the node that runs it (None: the
    machine `llmctl` runs on). `cluster up` and `serve -i` execute what these say."""

    key: str  # "cluster_up", "serve", "serve_node_1", ...
    argv: tuple[str, ...]
    host: str | None = None

    def render(self) -> str:
        text = shlex.join(self.argv)
        return f"{text}  # on {self.host}" if self.host else text

    def with_args(self, *args: str, host: str | None = None) -> RunStep:
        return RunStep(self.key, (*self.argv, *args), host or self.host)


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
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    ranks: tuple[RankMemory, ...]
    reasons: tuple[str, ...]
    rejected: tuple[tuple[str, str], ...]  # (layout, why not)
    alternatives: tuple[tuple[str, str], ...] = ()  # (layout, what it offers)
    steps: tuple[RunStep, ...] = ()  # what runs the plan, in order (the "Run" section)
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
    def commands(self) -> dict[str, str]:
        """The steps rendered (shlex.join), in the order they run: `cluster up` first."""
        return {step.key: step.render() for step in self.steps}

    def step(self, key: str) -> RunStep:
        return next(s for s in self.steps if s.key == key)

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
                f"each rank's KV cache is --kv-cache-space-gib ({gib(worst.kv_bytes, 2)}) "
                "exactly, as the engine allocates it"
            ]
        util, total = self.gpu_memory_utilization, self.gpu_memory_bytes
        nccl = f" + NCCL's buffers ({gib(NCCL_BYTES, 2)})" if self.gpus_used > 1 else ""
        return [
            f"the engine gives the KV cache what is left of {util:g} x {gib(total, 2)} = "
            f"{gib(int(total * util), 2)} per GPU after its profile step (a forward of "
            f"{self.profile_num_tokens:,} tokens as {self.profile_num_sampled} requests, one "
            f"sampled token each); estimated here for rank {worst.rank}, the one with the "
            "fewest blocks:",
            f"weights {gib(worst.weight_bytes, 2)}: its layers, embedding and LM head in "
            + (self.weight_format_detail or self.dtype),
            f"peak activations {gib(worst.activation_bytes, 2)}: per token the residual, hidden "
            "states, QKV and MLP intermediates; then the sampled rows' logits, in float32 with "
            f"the sampler's temporaries ({SAMPLER_BYTES_PER_LOGIT} bytes per vocabulary entry)",
            f"outside torch {gib(worst.non_torch_bytes, 2)}: the CUDA context "
            f"({gib(CUDA_CONTEXT_BYTES, 2)}){nccl}, a constant; the engine measures its own",
            f"KV cache {gib(worst.kv_bytes, 2)}: {worst.num_blocks:,} blocks of "
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


def gib(n: float, digits: int = 1) -> str:
    return f"{n / GIB:.{digits}f} GiB"
