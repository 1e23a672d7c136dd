"""Whether a layer runs its fused GPU kernel or its plain torch code, decided once per layer.

RMSNorm (with its residual add), rotary embedding and SiLU-and-mul each have one Triton kernel
(kernels/triton/, called through its torch custom op, llmctl::*) in place of the 3-9 torch ops
of their plain code. They run where the tensors are on CUDA and Triton is installed, and on the
simulated device of the device checks ("meta", where the ops' fake implementations give the
shapes: tests/device_check.py counts a step's ops). On the CPU the plain code runs: a custom op's
Python dispatch costs more there than the fusion saves, and a small decode step runs in the C++
fused decode stack anyway. LLMCTL_FUSED_LAYER_KERNELS=0 turns them off.
"""

from __future__ import annotations

import torch

from llmctl.engine import envs
from llmctl.engine.platform import triton_available


def use_fused_kernels(x: torch.Tensor) -> bool:
    return (
        x.device.type in ("cuda", "meta") and envs.LLMCTL_FUSED_LAYER_KERNELS and triton_available()
    )


def kernel_ops():
    """The custom ops' module (torch only: Triton is imported on a kernel's first real call)."""
    from llmctl.engine.kernels.triton import triton_ops

    return triton_ops
