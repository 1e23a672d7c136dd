"""MLP activations: SiLU-gated (Llama), GELU-tanh-gated (Gemma 3), GELU variants (GPT-2, OPT),
ReLU (OPT)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import UnsupportedArchitectureError
from llmctl.engine.kernels.cpu import layer_ops
from llmctl.engine.layers.fused_kernels import kernel_ops, use_fused_kernels


class SiluAndMul(nn.Module):
    """x: [num_tokens, 2 * d] as [gate | up] -> silu(gate) * up: [num_tokens, d]; on the GPU
    one Triton kernel (layers/fused_kernels.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._fused: bool | None = None  # decided at the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is None:
            self._fused = use_fused_kernels(x)
        if self._fused:
            return kernel_ops().silu_and_mul(x)
        d = x.shape[-1] // 2
        ops = layer_ops.ops_for(x)
        if ops is not None:  # on the CPU: one C++ pass (kernels/cpu/layer_ops.py)
            rows = x.reshape(-1, 2 * d).contiguous()
            return ops.silu_and_mul(rows).view(*x.shape[:-1], d)
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """x: [num_tokens, 2 * d] as [gate | up] -> gelu_tanh(gate) * up (Gemma 3's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gated_act_fn(name: str) -> nn.Module:
    """The [gate | up] activation of a gated MLP whose gate runs `name`."""
    if name.lower() in ("silu", "swish"):
        return SiluAndMul()
    if name.lower() in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul()
    raise UnsupportedArchitectureError(
        f"gated MLP activation {name!r} is not supported",
        "supported: silu, gelu_pytorch_tanh",
    )


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
}


def get_act_fn(name: str):
    try:
        return _ACTIVATIONS[name.lower()]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"activation {name!r} is not supported",
            f"supported activations: {', '.join(sorted(_ACTIVATIONS))}",
        ) from None
