"""RMSNorm (Llama family), with the residual add fused in, as Hugging Face computes it; on the
GPU one Triton kernel each (layers/fused_kernels.py), the residual add and the norm in place; on
the CPU one C++ pass per row with the same arithmetic (kernels/cpu/layer_ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from llmctl.engine.kernels.cpu import layer_ops
from llmctl.engine.layers.fused_kernels import kernel_ops, use_fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self._fused: bool | None = None  # decided at the first call (layers/fused_kernels.py)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given. On the GPU
        the latter is computed in place: x and residual are overwritten and returned."""
        if self._fused is None:
            self._fused = use_fused_kernels(x)
        if self._fused:
            ops = kernel_ops()
            if residual is None:
                return ops.rms_norm(x, self.weight, self.variance_epsilon)
            ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
            return x, residual
        ops = layer_ops.ops_for(x)
        if ops is not None and self.weight.dtype == x.dtype:
            shape, width = x.shape, x.shape[-1]
            rows = x.reshape(-1, width).contiguous()
            if residual is None:
                return ops.rms_norm(rows, self.weight, self.variance_epsilon).view(shape)
            res = residual.reshape(-1, width).contiguous()
            out, res = ops.fused_add_rms_norm(rows, res, self.weight, self.variance_epsilon)
            return out.view(shape), res.view(shape)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
