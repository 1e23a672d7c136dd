"""SiLU-gated activation on the GPU in one Triton kernel.

    silu_and_mul(x) -> out      # x: [num_tokens, 2 * d] as [gate | up]; out: [num_tokens, d]

out = silu(gate) * up, as torch computes `F.silu(gate) * up`: silu in float32 rounded to x's
dtype, then the product rounded again; x's rows may have any stride (the last dim contiguous).
One program per (token, BLOCK columns); the unfused path launches two kernels and writes and
reads silu(gate) in between. On CPU tensors the kernel runs only under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)  # rounded as F.silu's output is
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)
