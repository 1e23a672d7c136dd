"""The Triton kernels as torch custom ops (llmctl::*): paged attention, the packed
group-quantized matmul (engine/kernels/triton/triton_group_mm.py), and the layers' fused RMSNorm
(with its residual add), rotary embedding and SiLU-and-mul.

As ops, the kernels are single nodes to the dispatcher: CUDA graphs capture them like any kernel,
and on tensors without data (meta, fake) their fake implementations give the output's shape, so a
device check can run the whole CUDA path of a step on a machine without a GPU. The kernels
themselves (engine/kernels/triton/triton_attention.py) are imported on the first real call.
"""

from __future__ import annotations

import torch


def _kernels():
    from llmctl.engine.kernels.triton import triton_attention

    return triton_attention


@torch.library.custom_op("llmctl::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _kernels().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("llmctl::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return _kernels().paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, sinks
    )


@paged_decode_attention.register_fake
def _(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, sinks=None):
    return torch.empty_like(q)


@torch.library.custom_op("llmctl::prefill_attention", mutates_args=())
def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return _kernels().prefill_attention(
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        context_lens,
        max_query_len,
        scale,
        sliding_window,
        sinks,
    )


@prefill_attention.register_fake
def _(
    q,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    context_lens,
    max_query_len,
    scale,
    sliding_window,
    sinks=None,
):
    return torch.empty_like(q)


@torch.library.custom_op("llmctl::group_quantized_mm", mutates_args=())
def group_quantized_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    from llmctl.engine.kernels.triton.triton_group_mm import group_mm

    return group_mm(x, qweight, scales, zeros, bits, group_size)


@group_quantized_mm.register_fake
def _(x, qweight, scales, zeros, bits, group_size):
    return x.new_empty(x.shape[0], qweight.shape[0])


# -- multi-head latent attention (triton_mla.py) ----------------------------------------------


@torch.library.custom_op("llmctl::mla_write_cache", mutates_args=("cache",))
def mla_write_cache(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    from llmctl.engine.kernels.triton.triton_mla import mla_write_cache as write

    write(latent, k_pe, cache, slot_mapping)


@mla_write_cache.register_fake
def _(latent, k_pe, cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("llmctl::mla_decode_attention", mutates_args=())
def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    from llmctl.engine.kernels.triton.triton_mla import mla_decode_attention as decode

    return decode(q_latent, q_pe, cache, block_tables, seq_lens, scale)


@mla_decode_attention.register_fake
def _(q_latent, q_pe, cache, block_tables, seq_lens, scale):
    return torch.empty_like(q_latent)


# -- block FP8 (triton_fp8_gemm.py) -------------------------------------------------------------


@torch.library.custom_op("llmctl::fp8_block_mm", mutates_args=())
def fp8_block_mm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    from llmctl.engine.kernels.triton.triton_fp8_gemm import fp8_block_mm as mm

    return mm(x, qweight, scales, group_size)


@fp8_block_mm.register_fake
def _(x, qweight, scales, group_size):
    return x.new_empty(x.shape[0], qweight.shape[0])


# -- the layers' kernels (layers/layernorm.py, rotary_embedding.py, activation.py) ---------------


@torch.library.custom_op("llmctl::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from llmctl.engine.kernels.triton import triton_rms_norm

    return triton_rms_norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("llmctl::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    from llmctl.engine.kernels.triton import triton_rms_norm

    triton_rms_norm.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps) -> None:
    return None


@torch.library.custom_op("llmctl::rotary_embedding", mutates_args=("q", "k"))
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    from llmctl.engine.kernels.triton import triton_rotary

    triton_rotary.rotary_embedding(positions, q, k, cos_cache, sin_cache)


@rotary_embedding.register_fake
def _(positions, q, k, cos_cache, sin_cache) -> None:
    return None


@torch.library.custom_op("llmctl::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from llmctl.engine.kernels.triton import triton_activation

    return triton_activation.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
