"""The packed group-quantized matmul on the GPU, y = x W^T, in Triton.

W is a PackedLinearWeight (kernels.py): W[n, k] = q[n, k] * scales[n, k // G] + zeros[n, k // G],
q 4-bit (two nibbles a byte; inside each 32-element chunk byte j holds elements j and j + 16,
GGUF's Q4_0 order) or signed 8-bit, so every GGUF type llmctl reads (Q4_0, Q4_1, Q8_0, Q4_K,
Q6_K) and --quantization int4/int8 run on it. Two paths, by the number of rows M of x:

- M <= FUSED_MAX_ROWS (decode, small batches): group_mm_kernel reads each packed byte once,
  expands the W tile in registers and feeds tl.dot; W is never written out. A 4-bit tile is
  used as it lies: the low nibbles of a chunk's 16 bytes are its elements 0..15, the high ones
  16..31, so the kernel multiplies them by the matching halves of x rather than interleaving
  them. When the (M, N) tiles alone would leave the GPU's multiprocessors idle, K is split
  over programs too, and the partial sums (float32) are added in a fixed order: the same bits
  on every run.
- larger M (prefill): dequantize_kernel expands W to x's dtype in one pass and the GEMM runs on
  cuBLAS: at these M the GEMM's arithmetic dominates and cuBLAS runs it near peak; the expanded
  W is a temporary (the caching allocator reuses it layer to layer).

Activations keep their dtype (bfloat16 on the GPU by default; float32 dots run in IEEE float32,
not TF32), accumulation is float32. Under Triton's CPU interpreter (the tests,
TRITON_INTERPRET=1) bfloat16 is computed in float32: the interpreter's tl.dot multiplies
bfloat16's raw bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FUSED_MAX_ROWS = 64  # rows of x up to which the fused kernel runs; above, dequantize + cuBLAS


@triton.jit
def group_mm_kernel(
    x_ptr,  # [M, K] float, row stride stride_xm, unit column stride
    q_ptr,  # bits 4: uint8 [N, K // 2]; bits 8: int8 [N, K]
    s_ptr,  # [N, K // GROUP] float16 / float32
    z_ptr,  # [N, K // GROUP] like s_ptr (unused without HAS_ZEROS)
    y_ptr,  # [SPLIT_K, M, N]: float32 partial sums, or x's dtype when SPLIT_K is 1
    M,
    N,
    K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    rn64 = rn.to(tl.int64)
    groups = K // GROUP
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BITS == 4:
            b = tl.arange(0, BLOCK_K // 2)  # byte column of the tile
            k_lo = k0 + (b // 16) * 32 + (b % 16)  # the element its low nibble holds
            ok = k_lo < k_end  # K is a multiple of 32: a chunk is in or out whole
            w_ok = n_ok[:, None] & ok[None, :]
            packed = tl.load(
                q_ptr + rn64[:, None] * (K // 2) + (k0 // 2 + b)[None, :], mask=w_ok, other=0
            )
            # GROUP is a multiple of 32: both nibbles of a byte share a group
            g = rn64[:, None] * groups + (k_lo // GROUP)[None, :]
            s = tl.load(s_ptr + g, mask=w_ok, other=0.0).to(tl.float32)
            lo = (packed & 0xF).to(tl.float32) * s
            hi = (packed >> 4).to(tl.float32) * s
            if HAS_ZEROS:
                z = tl.load(z_ptr + g, mask=w_ok, other=0.0).to(tl.float32)
                lo += z
                hi += z
            x_ok = m_ok[:, None] & ok[None, :]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=x_ok, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_ok, other=0.0)
            if UPCAST:
                acc += tl.dot(x_lo.to(tl.float32), tl.trans(lo), input_precision=DOT_PRECISION)
                acc += tl.dot(x_hi.to(tl.float32), tl.trans(hi), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), input_precision=DOT_PRECISION)
                acc += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)), input_precision=DOT_PRECISION)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            ok = k < k_end
            w_ok = n_ok[:, None] & ok[None, :]
            q = tl.load(q_ptr + rn64[:, None] * K + k[None, :], mask=w_ok, other=0)
            g = rn64[:, None] * groups + (k // GROUP)[None, :]
            w = q.to(tl.float32) * tl.load(s_ptr + g, mask=w_ok, other=0.0).to(tl.float32)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & ok[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    out = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def dequantize_kernel(
    q_ptr,
    s_ptr,
    z_ptr,
    w_ptr,  # [N, K] out, the activations' dtype
    N,
    K,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    groups = K // GROUP
    w_rows = w_ptr + rn64[:, None] * K
    if BITS == 4:
        b = tl.arange(0, BLOCK_K // 2)
        k_lo = k0 + (b // 16) * 32 + (b % 16)
        ok = n_ok[:, None] & (k_lo < K)[None, :]
        packed = tl.load(
            q_ptr + rn64[:, None] * (K // 2) + (k0 // 2 + b)[None, :], mask=ok, other=0
        )
        g = rn64[:, None] * groups + (k_lo // GROUP)[None, :]
        s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
        lo = (packed & 0xF).to(tl.float32) * s
        hi = (packed >> 4).to(tl.float32) * s
        if HAS_ZEROS:
            z = tl.load(z_ptr + g, mask=ok, other=0.0).to(tl.float32)
            lo += z
            hi += z
        out_ty = w_ptr.dtype.element_ty
        tl.store(w_rows + k_lo[None, :], lo.to(out_ty), mask=ok)
        tl.store(w_rows + (k_lo + 16)[None, :], hi.to(out_ty), mask=ok)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (k < K)[None, :]
        q = tl.load(q_ptr + rn64[:, None] * K + k[None, :], mask=ok, other=0)
        g = rn64[:, None] * groups + (k // GROUP)[None, :]
        w = q.to(tl.float32) * tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
        tl.store(w_rows + k[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


def group_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x: [M, K] float -> [M, N] in x's dtype; the PackedLinearWeight's tensors on x's device."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if m > FUSED_MAX_ROWS:
        w = dequantize(qweight, scales, zeros, bits, group_size, k, x.dtype)
        return torch.mm(x, w.t())
    if m == 0 or n == 0:
        return x.new_empty(m, n)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    block_k = 128 if k >= 128 else 64 if k >= 64 else 32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    # Enough programs for about two waves over the multiprocessors, each still a few K steps.
    split = max(1, min(2 * _multiprocessors(x.device) // tiles, k_blocks // 4))
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(k, k_per_split)
    partial = torch.empty(
        split, m, n, dtype=torch.float32 if split > 1 else x.dtype, device=x.device
    )
    group_mm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        partial,
        m,
        n,
        k,
        x.stride(0),
        k_per_split,
        GROUP=group_size,
        BITS=bits,
        HAS_ZEROS=zeros is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=x.device.type == "cpu" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return partial[0] if split == 1 else partial.sum(0).to(x.dtype)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W [N, K] in `dtype` (one pass over the packed bytes)."""
    n = qweight.shape[0]
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 128 if k >= 128 else 32
    dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight,
        scales,
        zeros if zeros is not None else scales,
        w,
        n,
        k,
        GROUP=group_size,
        BITS=bits,
        HAS_ZEROS=zeros is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return w


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any count exercises the split
    return torch.cuda.get_device_properties(device).multi_processor_count
