"""RMSNorm on the GPU, alone or with the residual add before it, one Triton kernel each.

    rms_norm(x, weight, eps) -> out
    fused_add_rms_norm(x, residual, weight, eps)      # in place: residual = x + residual,
                                                      #           x = rms_norm(residual)

x, residual: [num_tokens, hidden] (rows of any stride, the last dim contiguous); weight:
[hidden]. The arithmetic is Hugging Face's, rounding for rounding: the residual sum is rounded to
x's dtype, the mean of squares and rsqrt are float32, the normalized row is rounded to the dtype
before the weight multiplies it (`weight * hidden.to(dtype)`): a bfloat16 model rounds where the
torch layer does (the float32 sum differs only in its order). One program per row: the whole row
(hidden padded to a power of two) in registers, read once and written once; the unfused path
launches 6 (norm) or 7 (add + norm) kernels and reads the row each time.
On CPU tensors the kernels run only under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2, out, weight, x2.stride(0), x2.stride(0), out.stride(0), x2.shape[1], eps,
            **_meta(x2, fused=False),
        )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, x, weight, x.stride(0), residual.stride(0), x.stride(0), x.shape[1], eps,
            **_meta(x, fused=True),
        )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with a contiguous last dim (a copy only where no view is)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _meta(x: torch.Tensor, fused: bool) -> dict:
    block = triton.next_power_of_2(x.shape[-1])
    return {
        "FUSED": fused,
        "BLOCK": block,
        "num_warps": 4 if block <= 2048 else 8 if block <= 8192 else 16,
    }


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    weight_ptr,
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    FUSED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if FUSED:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded as the torch add rounds
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(variance + eps)).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
