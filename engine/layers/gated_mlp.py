"""A quantized gated MLP (gate_up -> SiLU-and-mul -> down) in one pass of our prefill GEMM: the
layer side of the quantized matmul extension's amx_gated_mlp (kernels/cpu/amx_gemm.cpp) and
int8_gated_mlp (kernels/cpu/int8_gemm.cpp).

From 256 rows of bfloat16 activations (128 for int8; quantized_matmul.prefill_rows), on a CPU path
with a prefill GEMM of our own (quantized_matmul.prefill_gemm: AMX tiles, or int8 activations on
AVX512-VNNI), a Llama-style MLP whose gate_up and down projections each hold one packed weight
(GGUF or RTN int4/int8, no bias) runs as one kernel: both weights laid out once a call for that
GEMM (~0.3 ms a SmolLM2 layer in bfloat16 for AMX, ~0.15 ms in bytes for VPDPBUSD), then the
gate/up GEMM, SiLU-and-mul and the down GEMM over panels of rows that stay in the core's cache. The
gate/up output (50 MB for SmolLM2's 16 x 512-token step) never reaches memory. Its values are the
unfused layers' on the same path (each rounded where they round); on AMX sums of a few rows' shapes
may round one ulp apart from oneDNN's, whose kernels for those shapes add in another order.

Anything else (other CPU paths, decode batches, float weights, biases, shapes that are not
multiples of 32, an activation other than SiLU) gets None: the caller runs its layers.
"""

from __future__ import annotations

from typing import Any

import torch

from llmctl.engine.kernels.cpu import quantized_matmul as qm


def fused_gated_mlp(gate_up: torch.nn.Module, down: torch.nn.Module, x: torch.Tensor):
    """down(silu_and_mul(gate_up(x))) for x [tokens, H] in one kernel call, all-reduced like
    down's output where down is row-parallel; None where this path does not apply."""
    gu, dn = prefill_packed_weight(gate_up, x), prefill_packed_weight(down, x)
    if gu is None or dn is None:
        return None
    hidden, inter = gu.in_features, gu.out_features // 2
    if (dn.in_features, dn.out_features) != (inter, hidden):  # inter: a multiple of 32 (down's K)
        return None
    op, kind = prefill_op()
    mlp = getattr(op, f"{kind}_gated_mlp")
    out = mlp(x.contiguous(), gu.prefill_blocks(op, kind, inter), dn.prefill_blocks(op, kind))
    if down.tp_size > 1 and down.reduce_results:
        from llmctl.engine.distributed.parallel_state import get_tp_group

        out = get_tp_group().all_reduce(out)
    return out


def prefill_packed_weight(layer: torch.nn.Module, x: torch.Tensor) -> qm.PackedLinearWeight | None:
    """The layer's one packed weight where its GEMM on x runs on our prefill GEMM: bfloat16 rows
    of x from its prefill_rows on a path that has one, a shape it takes; else None."""
    if not (x.is_cpu and x.dtype == torch.bfloat16 and x.dim() == 2):
        return None
    if x.shape[0] < qm.INT8_LARGE_BATCH:
        return None
    w, prefill = _packed(layer), prefill_op()
    if w is None or prefill is None or x.shape[0] < qm.prefill_rows(prefill[1]):
        return None
    return w if w.prefill_kind(prefill[0]) is not None else None


def _packed(layer: torch.nn.Module) -> qm.PackedLinearWeight | None:
    """The layer's one packed weight, if that is all it holds (no bias, no float rows)."""
    method = getattr(layer, "quant_method", None)
    if method is None or layer.bias is not None or len(method.parts) != 1:
        return None
    part = method.parts[0]
    return part if type(part) is qm.PackedLinearWeight and part.qweight.is_cpu else None


def prefill_op() -> tuple[Any, str] | None:
    """The extension's ops and the prefill GEMM they run here ("amx" or "int8";
    quantized_matmul.prefill_gemm), or None where prefill batches use torch's GEMM."""
    op = qm._kernel()
    if op is None:
        return None
    kind = qm.prefill_gemm(op)
    return None if kind is None else (op, kind)
