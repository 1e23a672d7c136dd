"""Attention: the layer model code calls, paged KV cache and backend bound by the model runner.

    attn = Attention(num_heads, head_dim, scale, num_kv_heads)   # in a model's __init__
    out = attn(q, k, v)                                          # in its forward

A layer's own attention properties are the layer's, set by the model and read by every backend:
`sliding_window` (its queries see that many tokens, themselves included; None: all) and `sinks`
(gpt-oss: a learned logit per query head that joins every softmax's denominator, its own
weight, loaded by the model). The model runner binds each layer's KV cache ([2, num_blocks,
block_size, num_kv_heads, head_dim]: keys, then values; tensors shared by layers of different
KV cache groups, config/kv_cache_layout.py), its KV cache group and the runner's one attention
backend (attention/selector.py) with `bind`; the step's metadata (attention/metadata.py) comes
from the forward context, the layer reading its group's block tables. The layer never asks which
kernel runs.
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.engine.attention.backends.base import AttentionBackend
from llmctl.engine.attention.metadata import AttentionMetadata
from llmctl.engine.forward_context import get_attn_metadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        # [num_heads] in the model's dtype, this rank's heads (the model gives it a loader)
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        # [2, num_blocks, block_size, num_kv_heads, head_dim] and the backend, bound by the runner
        self.kv_cache = torch.empty(2, 0, 1, num_kv_heads, head_dim)
        self.kv_cache_group = 0
        self.backend: AttentionBackend | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The KV cache this layer needs for `num_blocks` blocks (the model runner allocates it)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bind(self, kv_cache: torch.Tensor, backend: AttentionBackend, group: int = 0) -> None:
        self.kv_cache = kv_cache
        self.backend = backend
        self.kv_cache_group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k, v: [num_tokens, num_kv_heads * head_dim]."""
        md: AttentionMetadata = get_attn_metadata().for_group(self.kv_cache_group)
        if self.backend is None:
            raise RuntimeError("Attention ran before the model runner bound its KV cache")
        num_tokens = q.shape[0]
        out = self.backend.forward(
            self,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            md,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        extra = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        extra += ", sinks" if self.sinks is not None else ""
        heads = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}"
        return f"{heads}, head_dim={self.head_dim}{extra}"
