"""A quantized gated MLP (gate_up -> SiLU-and-mul -> down) in one pass on AMX tiles: the layer
side of the quantized matmul extension's amx_gated_mlp (kernels/cpu/amx_gemm.cpp).

On the CPU's AMX path, from BF16_LARGE_BATCH rows of bfloat16 activations (prefill), a Llama-style
MLP whose gate_up and down projections each hold one packed weight (GGUF or RTN int4/int8, no
bias) runs as one kernel of the quantized matmul extension (amx_gemm.cpp): both weights
expanded once a call into bfloat16 blocks laid out for AMX (vnni_blocks_bf16, ~0.3 ms a SmolLM2
layer), then the gate/up GEMM, SiLU-and-mul and the down GEMM over panels of rows that stay in
the core's cache. The gate/up output never reaches memory. Its values are the unfused layers'
(each rounded where they round); sums of a few rows' shapes may round one ulp apart from
oneDNN's, whose kernels for those shapes add in another order.

Anything else (other CPU paths, decode batches, float weights, biases, shapes that are not
multiples of 32, an activation other than SiLU) gets None: the caller runs its layers.
"""

from __future__ import annotations

from typing import Any

import torch

from llmctl.engine.kernels.cpu import quantized_matmul as qm


def amx_gated_mlp(gate_up: torch.nn.Module, down: torch.nn.Module, x: torch.Tensor):
    """down(silu_and_mul(gate_up(x))) for x [tokens, H] in one kernel call, all-reduced like
    down's output where down is row-parallel; None where this path does not apply."""
    gu, dn = amx_packed_weight(gate_up, x), amx_packed_weight(down, x)
    if gu is None or dn is None:
        return None
    hidden, inter = gu.in_features, gu.out_features // 2
    if (dn.in_features, dn.out_features) != (inter, hidden):  # inter: a multiple of 32 (down's K)
        return None
    op = amx_op()
    out = op.amx_gated_mlp(x.contiguous(), gu.vnni_blocks(op, inter), dn.vnni_blocks(op))
    if down.tp_size > 1 and down.reduce_results:
        from llmctl.engine.distributed.parallel_state import get_tp_group

        out = get_tp_group().all_reduce(out)
    return out


def amx_packed_weight(layer: torch.nn.Module, x: torch.Tensor) -> qm.PackedLinearWeight | None:
    """The layer's one packed weight where its GEMM on x runs on our AMX tile loop: bfloat16 rows
    of x from BF16_LARGE_BATCH on the AMX path, N and K multiples of 32; else None."""
    if not (x.is_cpu and x.dtype == torch.bfloat16 and x.dim() == 2):
        return None
    if x.shape[0] < qm.BF16_LARGE_BATCH:
        return None
    w = _packed(layer)
    if w is None or w.out_features % 32 or w.in_features % 32 or amx_op() is None:
        return None
    return w


def _packed(layer: torch.nn.Module) -> qm.PackedLinearWeight | None:
    """The layer's one packed weight, if that is all it holds (no bias, no float rows)."""
    method = getattr(layer, "quant_method", None)
    if method is None or layer.bias is not None or len(method.parts) != 1:
        return None
    part = method.parts[0]
    return part if type(part) is qm.PackedLinearWeight and part.qweight.is_cpu else None


def amx_op() -> Any | None:
    """The extension's ops where prefill GEMMs run on AMX tiles (quantized_matmul.amx_tiles)."""
    op = qm._kernel()
    return op if op is not None and qm.amx_tiles(op) else None
