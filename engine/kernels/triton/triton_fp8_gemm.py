"""The block-FP8 GEMM on the GPU, y = x W^T, in Triton (DeepSeek-V3's W8A8 recipe, as vLLM runs
it).

W: an Fp8LinearWeight (kernels/cpu/fp8_matmul.py), float8_e4m3fn [N, K] with float32 scales
[N, ceil(K / G)] (G = 128: each row's copy of its block's weight_scale_inv). x is quantized on
the fly, per token and group of G features (`per_token_group_quant`): scale = max|x| / 448 over
the group, x / scale rounded to FP8. Then each (BLOCK_M, BLOCK_N) program walks K one group at a
time (BLOCK_K = G): an FP8 x FP8 tl.dot (FP8 tensor cores on compute capability 8.9+) and the
product scaled by the group's activation scales (per row) and weight scales (per column) before
it joins the float32 accumulator, so the tensor cores' own accumulation never spans more than
one group (DeepSeek-V3's promotion interval). Partial groups at K's edge read as zeros. The
output is in x's dtype.

Under Triton's CPU interpreter (TRITON_INTERPRET=1, the tests) the FP8 loads, the float -> FP8
rounding and the FP8 tl.dot run through numpy: what the kernel computes is checked there, but
not the tensor cores' accumulation precision or its speed (that needs a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)])."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quant_kernel[(m, groups)](
            x, q, scales, k, x.stride(0), q.stride(0), groups, GROUP=group, BLOCK=group
        )
    return q, scales


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, groups, GROUP: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + row * stride_q + cols, q, mask=ok)
    tl.store(s_ptr + row * groups + g, scale)


def fp8_block_mm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) times the FP8 weight (uint8 bits [N, K], row scales)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    xq, xs = per_token_group_quant(x.contiguous(), group_size)
    w = qweight.view(torch.float8_e4m3fn)
    # 64 rows at least: below that Triton lowers an FP8 dot on sm_90 to float16 MMAs (wgmma
    # needs 64; tests/kernels/test_triton_compile_fp8_mla.py checks the instructions)
    block_m = 64 if m <= 128 else 128
    block_n = 128 if n >= 128 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm_kernel[grid](
        xq, w, xs, scales, y,
        m, n, k,
        xq.stride(0), w.stride(0), xs.stride(0), scales.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group_size,
        num_warps=4 if block_m == 64 else 8,
        num_stages=3,
    )  # fmt: skip
    return y


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, y_ptr,
    M, N, K,
    stride_am, stride_bn, stride_asm, stride_bsn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + rn.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k = g * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + rm.to(tl.int64) * stride_asm + g, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + rn.to(tl.int64) * stride_bsn + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
