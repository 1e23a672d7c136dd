"""Attention: the layer model code calls, paged KV cache and backend bound by the model runner.

    attn = Attention(num_heads, head_dim, scale, num_kv_heads)   # in a model's __init__
    out = attn(q, k, v)                                          # in its forward

The model runner binds each layer's KV cache ([2, num_blocks, block_size, num_kv_heads,
head_dim]: keys, then values) and the runner's one attention backend (attention/selector.py)
with `bind`; the step's metadata (attention/metadata.py) comes from the forward context. The layer
never asks which kernel runs.
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.engine.attention.backends.base import AttentionBackend
from llmctl.engine.attention.metadata import AttentionMetadata
from llmctl.engine.forward_context import get_attn_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        # [2, num_blocks, block_size, num_kv_heads, head_dim] and the backend, bound by the runner
        self.kv_cache = torch.empty(2, 0, 1, num_kv_heads, head_dim)
        self.backend: AttentionBackend | None = None

    def bind(self, kv_cache: torch.Tensor, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k, v: [num_tokens, num_kv_heads * head_dim]."""
        md: AttentionMetadata = get_attn_metadata()
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
