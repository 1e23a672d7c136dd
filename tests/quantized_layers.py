"""Small quantized layers for the prefill GEMMs' tests (tests/kernels/test_amx_gemm.py and
test_int8_gemm.py): a packed RTN weight from a seed, and a Llama MLP with RTN int4 layers."""

from __future__ import annotations

import torch

from llmctl.engine.kernels.cpu import quantized_matmul as kernels
from llmctl.engine.layers.quantization.linear_method import set_quant_config
from llmctl.engine.layers.quantization.quant_config import QuantizationConfig
from llmctl.engine.layers.quantization.rtn import quantize_rtn


def packed(bits: int, group: int, n: int, k: int, seed: int) -> kernels.PackedLinearWeight:
    """An [n, k] weight of random normals, RTN-quantized to `bits` in groups, float16 scales."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, scales, zeros = quantize_rtn(w, bits, group)
    return kernels.pack_groups(q, scales.to(torch.float16), zeros, bits, group)


def quantized_mlp(h: int, i: int):
    """A LlamaMLP (hidden h, intermediate i) whose gate_up and down hold RTN int4 weights."""
    from llmctl.engine.models.llama import LlamaMLP

    with set_quant_config(QuantizationConfig(method="int4", group_size=32)):
        mlp = LlamaMLP(h, i, bias=False)
    g = torch.Generator().manual_seed(7)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, torch.randn(i, h, generator=g), 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, torch.randn(i, h, generator=g), 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, torch.randn(h, i, generator=g) / 8)
    return mlp
