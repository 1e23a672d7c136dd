"""A quantized linear layer and the row operation after it in one pass of our prefill GEMM: QKV
with RoPE on its queries and keys, O with the residual add and RMSNorm that follow it (the
quantized matmul extension's amx_linear_rope and amx_linear_add_rms_norm, amx_gemm.cpp, or
int8_linear_rope and int8_linear_add_rms_norm, int8_gemm.cpp).

Each thread computes the GEMM for a panel of rows (256 on AMX, up to 96 on int8) into a buffer that
stays in its core's L2, rotates or normalizes those rows there (layer_ops_cpu.h's rope_row and
add_rms_norm_row, the code the separate ops run) and writes them out once. Separately, the GEMM's
output went to memory and the next op read it back and wrote it again: RoPE took ~2.9 ms a SmolLM2
layer of a 16 x 512-token prefill, reading rows the GEMM had just evicted, and the norm after O
~2.2 ms. The values are the separate ops' bits (on the same prefill GEMM).

Where it applies is gated_mlp.py's rule (a path with a prefill GEMM, bfloat16 rows from
prefill_rows, one packed weight without bias, N and K multiples of 32), plus: a plain rotary
table of the head's width; the plain RMSNorm in x's dtype, and O not all-reduced (tensor parallel
size 1). Elsewhere the functions return None and the caller runs its layers.
"""

from __future__ import annotations

import torch

from llmctl.engine.layers.gated_mlp import prefill_op, prefill_packed_weight
from llmctl.engine.layers.layernorm import RMSNorm
from llmctl.engine.layers.rotary_embedding import RotaryEmbedding


def linear_rope(
    qkv_proj: torch.nn.Module,
    rotary_emb: RotaryEmbedding,
    positions: torch.Tensor,
    x: torch.Tensor,
    rotary_columns: int,
) -> torch.Tensor | None:
    """qkv_proj(x) with RoPE at `positions` applied to each row's first `rotary_columns` (the
    query and key heads); None where this path does not apply."""
    w = prefill_packed_weight(qkv_proj, x)
    if w is None or not rotary_emb.plain or type(rotary_emb) is not RotaryEmbedding:
        return None
    cos, sin = rotary_emb.cos_cache, rotary_emb.sin_cache
    if cos.dtype != torch.float32 or rotary_columns % cos.shape[1]:
        return None
    op, kind = prefill_op()
    return getattr(op, f"{kind}_linear_rope")(
        x.contiguous(), w.prefill_blocks(op, kind), positions, cos, sin, rotary_columns
    )


def linear_add_rms_norm(
    o_proj: torch.nn.Module, norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """norm(o_proj(x), residual): (the normalized sum, the sum); None where this path does not
    apply."""
    w = prefill_packed_weight(o_proj, x)
    if w is None or o_proj.tp_size > 1 or type(norm) is not RMSNorm:
        return None
    if norm.weight.dtype != x.dtype or residual.dtype != x.dtype:
        return None
    op, kind = prefill_op()
    shape = residual.shape
    res = residual.reshape(-1, shape[-1]).contiguous()
    out, res = getattr(op, f"{kind}_linear_add_rms_norm")(
        x.contiguous(), w.prefill_blocks(op, kind), res, norm.weight, norm.variance_epsilon
    )
    return out.view(shape), res.view(shape)
