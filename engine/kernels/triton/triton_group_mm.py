"""The packed group-quantized matmul on the GPU, y = x W^T, in Triton.

W is a PackedLinearWeight (kernels/cpu/quantized_matmul.py): W[n, k] = q[n, k] * scales[n, k // G] +
zeros[n, k // G], q 4-bit (two nibbles a byte; inside each 32-element chunk byte j holds elements j
and j + 16, GGUF's Q4_0 order) or signed 8-bit, so every GGUF type llmctl reads (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K) and --quantization int4/int8 run on it. The weights stay packed on the GPU in that
layout, which the kernel reads as it lies, at every M: group_mm_kernel reads each packed byte once
per M tile, expands the W tile in registers and feeds tl.dot; W is never written out, neither at
decode nor at prefill, nor in a CUDA graph's replay (an earlier version expanded the whole weight
per call above 64 rows). A 4-bit tile is used as it lies: the low nibbles of a chunk's 16 bytes
are its elements 0..15, the high ones 16..31, so the kernel multiplies them by the matching
halves of x rather than interleaving them. Tiles grow with M (fused_tiles: 16 to 64 rows, and
128 columns of W up to 16 rows and above 64). When the (M, N) tiles alone would leave the GPU's
multiprocessors idle, and at least 8 ways up to 16 rows, K is split over programs too, and the
partial sums (float32) are added in a fixed order by one reduction into the output: the same
bits on every run. dequantize_kernel expands W (references, benchmarks).

Both kernels load a scale (and zero) once per 32-element chunk (per SUB columns for 8 bits) and
spread it in registers, and address the weight bytes, x and the expanded W as rows of 16-element
runs, so that tiles move as 16-byte copies (tests/kernels/test_triton_compile.py checks the
compiled sm_90 code for it). The previous version, which gathered a scale and a zero per weight,
ran at 0.15-0.45x cuBLAS bfloat16 at decode on an H100; this one, with these tiles, at about 0.7x
on an H200 (docs/benchmarks.md: Llama-3.1-8B's shapes, group 32). Still slower than bfloat16 at
decode, with 4x fewer bytes: the expansion (nibble to float32, scale and zero per weight, to
bfloat16) costs more than the bytes save. Products summed in registers instead of tl.dot
(USE_DOT=False) lost to tl.dot at 1 to 8 rows there.

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

# Rows of x up to which the tiles are decode's (16-64 rows x 64 columns of W); above, prefill's.
FUSED_MAX_ROWS = 64
# K split at least this many ways for up to 16 rows of x (where K allows 4 steps a program)
DECODE_SPLIT = 8


@triton.jit
def expand_int4(
    q_rows, s_rows, z_rows, k0, k_end, n_ok,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Columns [k0, k0 + BLOCK_K) of 4-bit rows as float32 (lo, hi), [BLOCK_N, BLOCK_K // 2]
    each, in the bytes' order: lo[:, 16c + j] is W's column k0 + 32c + j, hi's is 16 further on;
    and the chunks' first columns (k0 + 32c) with their mask (< k_end)."""
    CHUNKS: tl.constexpr = BLOCK_K // 32
    HALF: tl.constexpr = BLOCK_K // 2
    cols = k0 // 2 + tl.arange(0, HALF)
    packed = tl.load(
        q_rows + cols[None, :], mask=n_ok[:, None] & (cols < k_end // 2)[None, :], other=0
    )
    # one scale (and zero) a chunk, spread over its 16 bytes in registers
    chunk = k0 + 32 * tl.arange(0, CHUNKS)
    c_ok = chunk < k_end
    g_ok = n_ok[:, None] & c_ok[None, :]
    g = (chunk // GROUP)[None, :]
    s = tl.load(s_rows + g, mask=g_ok, other=0.0).to(tl.float32)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, CHUNKS, 16)), (BLOCK_N, HALF))
    lo = (packed & 0xF).to(tl.float32) * s
    hi = (packed >> 4).to(tl.float32) * s
    if HAS_ZEROS:
        z = tl.load(z_rows + g, mask=g_ok, other=0.0).to(tl.float32)
        z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, CHUNKS, 16)), (BLOCK_N, HALF))
        lo += z
        hi += z
    return lo, hi, chunk, c_ok


@triton.jit
def expand_int8(
    q_rows, s_rows, k0, k_end, n_ok,
    GROUP: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Columns [k0, k0 + BLOCK_K) of 8-bit rows as float32 [BLOCK_N, BLOCK_K] (one scale per SUB
    columns, spread in registers), those columns and their mask (< k_end)."""
    SUBS: tl.constexpr = BLOCK_K // SUB
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < k_end
    q = tl.load(q_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    sub = k0 + SUB * tl.arange(0, SUBS)
    s = tl.load(
        s_rows + (sub // GROUP)[None, :], mask=n_ok[:, None] & (sub < k_end)[None, :], other=0.0
    ).to(tl.float32)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, SUBS, SUB)), (BLOCK_N, BLOCK_K))
    return q.to(tl.float32) * s, k, k_ok


@triton.jit
def _row_dot(x, w):
    """[BLOCK_M, BLOCK_K] x [BLOCK_N, BLOCK_K] -> [BLOCK_M, BLOCK_N], float32 products summed
    over K in registers: no tensor-core tile of 16 rows for a step of one to four."""
    return tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def group_mm_kernel(
    x_ptr,  # [M, K] float, row stride stride_xm, unit column stride
    q_ptr,  # bits 4: uint8 [N, K // 2]; bits 8: int8 [N, K]; row stride stride_qn
    s_ptr,  # [N, K // GROUP] float16 / float32, row stride stride_sn
    z_ptr,  # like s_ptr (unused without HAS_ZEROS)
    y_ptr,  # [SPLIT_K, M, N]: float32 partial sums, or x's dtype when SPLIT_K is 1
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    k_per_split,  # a multiple of BLOCK_K
    GROUP: tl.constexpr,
    SUB: tl.constexpr,  # min(GROUP, BLOCK_K): columns of a tile sharing one scale
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,  # False: products summed in registers (benchmarks/group_mm_tiles.py)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64) * stride_xm  # [BLOCK_M] row starts
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + rn.to(tl.int64)[:, None] * stride_sn
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        if BITS == 4:
            HALF: tl.constexpr = BLOCK_K // 2
            lo, hi, chunk, c_ok = expand_int4(
                q_rows, s_rows, z_rows, k0, k_end, n_ok, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K
            )
            # x's first and second 16 of each chunk, against the low and the high nibbles
            x_at = x_rows[:, None, None] + chunk[None, :, None] + tl.arange(0, 16)[None, None, :]
            x_ok = m_ok[:, None, None] & c_ok[None, :, None]
            x_lo = tl.reshape(tl.load(x_at, mask=x_ok, other=0.0), (BLOCK_M, HALF))
            x_hi = tl.reshape(tl.load(x_at + 16, mask=x_ok, other=0.0), (BLOCK_M, HALF))
            if not USE_DOT:
                acc += _row_dot(x_lo, lo) + _row_dot(x_hi, hi)
            elif UPCAST:
                acc += tl.dot(x_lo.to(tl.float32), tl.trans(lo), input_precision=DOT_PRECISION)
                acc += tl.dot(x_hi.to(tl.float32), tl.trans(hi), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), input_precision=DOT_PRECISION)
                acc += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)), input_precision=DOT_PRECISION)
        else:
            w, k, k_ok = expand_int8(q_rows, s_rows, k0, k_end, n_ok, GROUP, SUB, BLOCK_N, BLOCK_K)
            x = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if not USE_DOT:
                acc += _row_dot(x, w)
            elif UPCAST:
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
    stride_qn,
    stride_sn,
    GROUP: tl.constexpr,
    SUB: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.multiple_of(tl.program_id(1) * BLOCK_K, BLOCK_K)
    n_ok = rn < N
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + rn.to(tl.int64)[:, None] * stride_sn
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    out_ty = w_ptr.dtype.element_ty
    if BITS == 4:
        CHUNKS: tl.constexpr = BLOCK_K // 32
        lo, hi, chunk, c_ok = expand_int4(
            q_rows, s_rows, z_rows, k0, K, n_ok, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K
        )
        at = w_rows[:, :, None] + chunk[None, :, None] + tl.arange(0, 16)[None, None, :]
        ok = n_ok[:, None, None] & c_ok[None, :, None]
        tl.store(at, tl.reshape(lo, (BLOCK_N, CHUNKS, 16)).to(out_ty), mask=ok)
        tl.store(at + 16, tl.reshape(hi, (BLOCK_N, CHUNKS, 16)).to(out_ty), mask=ok)
    else:
        w, k, k_ok = expand_int8(q_rows, s_rows, k0, K, n_ok, GROUP, SUB, BLOCK_N, BLOCK_K)
        tl.store(w_rows + k[None, :], w.to(out_ty), mask=n_ok[:, None] & k_ok[None, :])


def fused_tiles(m: int, k: int, dtype: torch.dtype) -> dict:
    """The fused kernel's tile sizes and launch options for x of [m, k] in `dtype`. float32
    tiles take two pipeline stages instead of three, and K steps of 64 at 64 rows, so that every
    tile fits the 99 KiB of shared memory a block may have on sm_86/sm_89 GPUs
    (tests/kernels/test_triton_compile.py compiles each for sm_90 and checks)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    wide = dtype == torch.float32 and block_m == 64
    if m > FUSED_MAX_ROWS:  # prefill: 64 x 128 output tiles, each W tile used by 64 rows
        return dict(
            BLOCK_M=64,
            BLOCK_N=128,
            BLOCK_K=64 if k >= 64 and dtype != torch.float32 else 32,
            USE_DOT=True,
            num_warps=8,
            num_stages=2 if dtype == torch.float32 else 3,
        )
    return dict(
        BLOCK_M=block_m,
        # 128 columns of W a program at up to 16 rows, with K split up to 8 ways (group_mm):
        # 1.1-2.1x faster than 64 columns on an H200 (benchmarks/group_mm_tiles.py)
        BLOCK_N=128 if m <= 16 else 64,
        BLOCK_K=128 if k >= 128 and not wide else 64 if k >= 64 else 32,
        USE_DOT=True,
        num_warps=4,
        num_stages=2 if dtype == torch.float32 else 3,
    )


def group_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    tiles: dict | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x: [M, K] float -> [M, N] in x's dtype; the PackedLinearWeight's tensors on x's device
    (contiguous, as pack_groups makes them: the kernels take one row stride for the scales and
    the zeros, and unit column strides). `tiles` and `split` replace fused_tiles' choice and the
    K split (benchmarks/group_mm_tiles.py tries them)."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    if m == 0 or n == 0:
        return x.new_empty(m, n)
    tiles = tiles or fused_tiles(m, k, x.dtype)
    block_m, block_n, block_k = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    # Enough programs for about two waves over the multiprocessors, each still a few K steps;
    # a decode step's few rows split K at least 8 ways (its programs only stream W).
    if split is None:
        waves = 2 * _multiprocessors(x.device) // grid_mn
        split = max(1, min(max(waves, DECODE_SPLIT) if m <= 16 else waves, k_blocks // 4))
    split = max(1, min(split, k_blocks))
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
        qweight.stride(0),
        scales.stride(0),
        k_per_split,
        GROUP=group_size,
        SUB=min(group_size, block_k),
        BITS=bits,
        HAS_ZEROS=zeros is not None,
        UPCAST=x.device.type == "cpu" and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **tiles,
    )
    if split == 1:
        return partial[0]
    return torch.sum(partial, dim=0, out=x.new_empty(m, n))  # one reduction, in a fixed order


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
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 128 if k >= 128 else 32
    dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight,
        scales,
        zeros if zeros is not None else scales,
        w,
        n,
        k,
        qweight.stride(0),
        scales.stride(0),
        GROUP=group_size,
        SUB=min(group_size, block_k),
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
