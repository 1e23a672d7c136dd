"""Writing a step's keys and values into the paged KV cache with a Triton kernel.

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

key, value: [num_tokens, num_kv_heads, head_dim] (any strides; the last dim contiguous is the
fast case); key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], the two
halves of one layer's [2, num_blocks, block_size, num_kv_heads, head_dim] tensor (any strides);
slot_mapping: [num_tokens] int32 or int64. Token i goes to block slot_mapping[i] // block_size,
row slot_mapping[i] % block_size; a negative slot skips the token (the padding rows of a
CUDA-graph batch). Values are cast to the cache's dtype.

One program per token copies all of its KV heads: [num_kv_heads, head_dim] of K and of V. Block
ids are widened to int64 before they meet a stride, so caches past 2**31 elements address right.
On CPU tensors the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key[i], value[i] at cache slot slot_mapping[i]; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        num_kv_heads,
        head_dim,
        block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    k_dst = (
        key_cache_ptr
        + block * stride_kcb
        + offset * stride_kco
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    v_dst = (
        value_cache_ptr
        + block * stride_vcb
        + offset * stride_vco
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
