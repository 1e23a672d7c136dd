"""AttentionBackend: what the Attention layer asks of a kernel family."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmctl.engine.attention.layer import Attention
    from llmctl.engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    name = "base"
    # CUDA graphs pad a batch with slots of -1 that must not be written (the Triton cache write
    # skips them; index_copy_ cannot).
    supports_cuda_graphs = False
    # The CPU's fused decode stack (kernels/cpu/fused_decode.py) calls the C++ decode kernel.
    runs_cpu_decode_kernel = False
    # A step with a prefill chunk gives every sequence to one varlen kernel (its decodes as
    # one-token chunks): one launch per layer, and a grid a CUDA graph of the step can replay.
    unified_mixed_steps = False

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k and v at md.slot_mapping in `layer.kv_cache`, then attend."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
