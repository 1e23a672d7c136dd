"""get_attn_backend: which attention backend a model runner uses, decided once when it is built.

LLMCTL_ATTENTION_BACKEND   CPU                        CUDA
auto (default)             cpu (C++ decode kernel)    triton (torch without Triton)
torch                      cpu                        torch
triton                     triton (TRITON_INTERPRET=1 runs it: the tests do)   triton
"""

from __future__ import annotations

import torch

from llmctl.engine import envs
from llmctl.engine.attention.backends.base import AttentionBackend
from llmctl.engine.errors import ConfigError
from llmctl.engine.platform import triton_available


def get_attn_backend(device: torch.device) -> AttentionBackend:
    choice = envs.LLMCTL_ATTENTION_BACKEND
    if choice == "triton" and not triton_available():
        raise ConfigError(
            "LLMCTL_ATTENTION_BACKEND=triton, but Triton is not installed",
            "pip install triton, or unset LLMCTL_ATTENTION_BACKEND",
        )
    if choice == "triton" or (choice == "auto" and device.type != "cpu" and triton_available()):
        from llmctl.engine.attention.backends.triton import TritonAttentionBackend

        return TritonAttentionBackend()
    if device.type == "cpu":
        from llmctl.engine.attention.backends.cpu import CPUAttentionBackend

        return CPUAttentionBackend()
    from llmctl.engine.attention.backends.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend()
