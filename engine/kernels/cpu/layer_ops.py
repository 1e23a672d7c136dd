"""The elementwise parts of a Llama-family layer as C++ ops on the CPU (layer_ops_cpu.cpp).

RMSNorm with its residual add, RoPE and SiLU-and-mul each take one pass over the activations in
float32 or bfloat16, rounding where torch's ops round (layer_ops_cpu.h), rows split across
threads. In torch each is several ops and, in bfloat16, a conversion each way per op: they took
half of a bfloat16 prefill of SmolLM2 on the Intel AMX machine (16 x 512 tokens, 2 threads).
The layers (layernorm.py, rotary_embedding.py, activation.py) call `ops_for(x)` and run their
torch code when it returns None: another device or dtype, or no C++ compiler (the fused decode
kernel's warning says why). The ops live in the fused decode extension, which runs the same row
routines inside its decode step.
"""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = (torch.float32, torch.bfloat16)
_ops: Any | None = None  # the extension's op namespace once loaded
_tried = False


def ops_for(x: torch.Tensor) -> Any | None:
    """The op namespace (`rms_norm`, `fused_add_rms_norm`, `rotary_embedding_`, `silu_and_mul`)
    when it can take `x` (a CPU float32 or bfloat16 tensor), else None."""
    if not (x.dtype in _DTYPES and x.device.type == "cpu"):
        return None
    if _ops is None and not _tried:
        _load()
    return _ops


def _load() -> None:
    global _ops, _tried
    from llmctl.engine.kernels.cpu import fused_decode

    _tried = True
    name = fused_decode._namespace()  # builds (or loads) the extension; None without a compiler
    _ops = getattr(torch.ops, name) if name is not None else None
