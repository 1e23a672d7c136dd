"""Memory for the KV cache, sized as vLLM does it: the engine measures, `llmctl plan` estimates.

On the CPU the KV cache of each rank is kv_cache_space_gib exactly (`cpu_num_gpu_blocks`); the
worker divides it by the bytes per block of the attention layers it built, the planner by
`ModelShape.kv_cache_bytes_per_block`, and both take the rank with the fewest blocks.

After loading its weights, each CUDA worker empties torch's cache, resets the peak counter and runs
one profile step: a forward of max_num_batched_tokens tokens split over dummy requests
(`profile_request_lengths`), then the LM head and the sampler on one row per request. Then

    peak_torch  = torch.cuda.max_memory_allocated()             # weights + peak activations
    non_torch   = (total - free) - torch.cuda.memory_reserved()  # CUDA context, NCCL, other
                                                                 # processes on the GPU
    kv_cache    = total x gpu_memory_utilization - peak_torch - non_torch
    num_blocks  = kv_cache // bytes per block

The planner fills the same MemoryProfile from estimates (`estimate_activation_bytes`,
`estimate_non_torch_bytes`) and calls the same arithmetic, so it predicts the number the engine
logs. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.engine.errors import ConfigError, DeviceMemoryError

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 4.0  # as vLLM's VLLM_CPU_KVCACHE_SPACE

# Non-torch memory, for the planner. One process on one GPU: the CUDA context with its loaded
# modules (torch's, cuBLAS's, Triton's kernels), 0.4-0.6 GiB on an H100 with CUDA 12's lazy
# loading. Several ranks add NCCL's communicator buffers (channels x peers x protocol buffers).
# Both are estimates; the engine measures its own.
CUDA_CONTEXT_BYTES = 512 * MIB
NCCL_BYTES = 512 * MIB

# Bytes per entry of the sampled rows' [rows, vocab] logits at the sampler's peak. The profile step
# samples every row randomly with top-k and top-p (a real batch may): the float32 logits (4), the
# scaled copy (4), the sorted values (4) and their int64 order (8), the softmax's cumulative sum
# (4 + 1 for its mask) and the masked and scattered copies (4): 29 at the peak, rounded up to 32
# for min-p and logprobs.
SAMPLER_BYTES_PER_LOGIT = 32


def check_gpu_memory_utilization(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {value}",
            "pass --gpu-memory-utilization a fraction of each GPU's memory, such as 0.9 "
            "(the default)",
        )


def profile_request_lengths(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[int]:
    """Prompt lengths of the profile step's dummy requests, as vLLM makes them: the step's token
    budget (at most max_num_seqs requests of max_model_len) split evenly over as many requests as
    a step may hold; each samples one token. 8192 tokens, 256 requests: 256 prompts of 32."""
    tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_requests = max(1, min(max_num_seqs, tokens))
    base, extra = divmod(tokens, num_requests)
    return [base + (1 if i < extra else 0) for i in range(num_requests)]


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's GPU after loading its weights and running the profile step."""

    total_bytes: int  # the GPU's memory (torch.cuda.mem_get_info()[1])
    weight_bytes: int  # allocated before the profile step: the model's weights and buffers
    peak_torch_bytes: int  # allocated at the profile step's peak: weights + activations
    non_torch_bytes: int  # used on the GPU outside torch's allocator

    @property
    def activation_bytes(self) -> int:
        return self.peak_torch_bytes - self.weight_bytes

    def usable_bytes(self, gpu_memory_utilization: float) -> int:
        return int(self.total_bytes * gpu_memory_utilization)

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        """What is left for the KV cache; negative when even the weights and activations do
        not fit the utilization."""
        return (
            self.usable_bytes(gpu_memory_utilization) - self.peak_torch_bytes - self.non_torch_bytes
        )

    def describe(self, gpu_memory_utilization: float) -> str:
        """One line with every term, as the worker logs it and errors quote it."""
        return (
            f"{gpu_memory_utilization:g} x {_gib(self.total_bytes)} = "
            f"{_gib(self.usable_bytes(gpu_memory_utilization))} usable: weights "
            f"{_gib(self.weight_bytes)}, peak activations {_gib(self.activation_bytes)}, "
            f"non-torch {_gib(self.non_torch_bytes)}, KV cache "
            f"{_gib(self.kv_cache_bytes(gpu_memory_utilization))}"
        )


def num_gpu_blocks(profile: MemoryProfile, gpu_memory_utilization: float, block_bytes: int) -> int:
    """KV cache blocks that fit; DeviceMemoryError naming the knobs when nothing is left."""
    budget = profile.kv_cache_bytes(gpu_memory_utilization)
    if budget <= 0:
        raise DeviceMemoryError(
            f"no GPU memory is left for the KV cache: {profile.describe(gpu_memory_utilization)}",
            f"raise --gpu-memory-utilization (now {gpu_memory_utilization:g}), lower "
            "--max-num-batched-tokens or --max-num-seqs (the profile step's size), or split the "
            "model over more GPUs with -tp/-pp",
        )
    return budget // block_bytes


def cpu_num_gpu_blocks(kv_cache_space_gib: float | None, block_bytes: int) -> int:
    """KV cache blocks of one CPU rank: kv_cache_space_gib (None: the default) over the bytes of
    one block on that rank. The engine's count is the smallest over its ranks."""
    space = kv_cache_space_gib or DEFAULT_CPU_KV_CACHE_SPACE_GIB
    return int(space * GIB) // block_bytes


def estimate_activation_bytes(
    *,
    num_tokens: int,
    num_sampled: int,
    hidden_size: int,
    qkv_size: int,
    intermediate_size: int,
    vocab_shard: int,
    vocab_size: int,
    dtype_bytes: int,
    gated_mlp: bool,
    is_last_stage: bool,
    samples: bool,
) -> int:
    """Peak activations of the profile step on one rank (sizes are this rank's shards).

    Decoder layers, per token, in the model's dtype: attention holds the residual, the layer's
    input and its normed copy and the attention output (4 hidden), the QKV projection and its
    rotated copy (2 qkv); the MLP holds 3 hidden and, gated (SiLU x up), gate_up, the SiLU and
    the product (4 intermediate), else the up projection and its activation (2 intermediate).
    The last stage then keeps the final hidden states and computes the sampled rows' logits (its
    vocabulary shard); the rank that samples also gathers the full row (tp > 1) and runs the
    sampler (SAMPLER_BYTES_PER_LOGIT per entry). The peak is the larger of the two phases.
    """
    attention = 4 * hidden_size + 2 * qkv_size
    mlp = 3 * hidden_size + (4 if gated_mlp else 2) * intermediate_size
    forward = num_tokens * max(attention, mlp) * dtype_bytes
    if not is_last_stage:
        return forward
    logits = (num_tokens + num_sampled) * hidden_size * dtype_bytes
    logits += num_sampled * vocab_shard * dtype_bytes
    if samples:
        if vocab_shard != vocab_size:
            logits += num_sampled * vocab_size * dtype_bytes
        logits += num_sampled * vocab_size * SAMPLER_BYTES_PER_LOGIT
    return max(forward, logits)


def estimate_non_torch_bytes(world_size: int) -> int:
    """The CUDA context, plus NCCL's buffers when there are several ranks."""
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if world_size > 1 else 0)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
