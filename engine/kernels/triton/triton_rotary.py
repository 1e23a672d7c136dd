"""Rotary position embedding on the GPU: the query and key heads of every token rotated in place,
one Triton kernel.

    rotary_embedding(positions, q, k, cos_cache, sin_cache)

q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], any strides with
the last dim contiguous (views into the QKV projection's output: no copy is made);
positions: [num_tokens]; cos_cache, sin_cache: [max_position, head_dim] float32, each row two
equal halves (Hugging Face's "rotate half" layout: x1 = x[:d/2], x2 = x[d/2:], out = (x1 cos -
x2 sin, x2 cos + x1 sin)). Computed in float32, stored in q's and k's dtype. One program per
token: its cos/sin row is read once for all its heads, q's and k's; the unfused path gathers
cos and sin, builds the rotated half (neg, cat) and multiplies and adds, for q and k apart.
On CPU tensors the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        num_heads, num_kv_heads, half,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        BLOCK_D=triton.next_power_of_2(half),
    )  # fmt: skip


@triton.jit
def _rotate(
    ptr,
    stride_t,
    stride_h,
    token,
    heads,
    half,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotate `heads` heads of one token at `ptr` in place; cos, sin: [1, BLOCK_D] float32."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < half)  # [BLOCK_H, BLOCK_D]
    first = ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_heads,
    num_kv_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + position * stride_cos + offs_d, mask=offs_d < half, other=0.0)
    sin = tl.load(sin_ptr + position * stride_cos + offs_d, mask=offs_d < half, other=0.0)
    cos, sin = cos[None, :], sin[None, :]  # [1, BLOCK_D]: one row for every head
    _rotate(q_ptr, stride_qt, stride_qh, token, num_heads, half, cos, sin, BLOCK_H, BLOCK_D)
    _rotate(k_ptr, stride_kt, stride_kh, token, num_kv_heads, half, cos, sin, BLOCK_H, BLOCK_D)
