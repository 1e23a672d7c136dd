"""Paged attention on the CPU with PyTorch's scaled_dot_product_attention.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).
Token t of a sequence lives in slot block_table[t // block_size] * block_size + t % block_size.

A step's tokens are laid out decodes first (one token per sequence), then prefills (a chunk of
one sequence each). Decodes run as one call of the fused paged-attention kernel
(paged_attention_cpu: each K/V row read once, straight from the blocks, for all the query heads
that share it; gather + SDPA where the kernel cannot be built). Prefill chunks attend to their
own keys (causal) or, after a prefix-cache hit or an earlier chunk, to the gathered cache with an
offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.forward_context import get_attn_metadata
from llmctl.engine.layers.paged_attention_cpu import paged_decode_attention


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the step's token layout
    query_len: int
    seq_len: int  # tokens in the sequence once this chunk is computed
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)]; None when nothing is cached
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend; None: plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, the new token included
    sliding_window: int | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        # [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the model runner.
        self.kv_cache = torch.empty(2, 0, 1, num_kv_heads, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k, v: [num_tokens, num_kv_heads * head_dim]."""
        md: AttentionMetadata = get_attn_metadata()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = self.kv_cache.unbind(0)
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        key_cache.view(flat_shape).index_copy_(0, md.slot_mapping, k)
        value_cache.view(flat_shape).index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[: md.num_decodes] = self._decode(q[: md.num_decodes], md, key_cache, value_cache)
        for chunk in md.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], chunk, key_cache, value_cache)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q, md: AttentionMetadata, key_cache, value_cache) -> torch.Tensor:
        return paged_decode_attention(
            q,
            key_cache,
            value_cache,
            md.decode_block_tables,
            md.decode_seq_lens,
            self.scale,
            md.sliding_window,
        )

    def _prefill(self, q, k, v, chunk: PrefillChunk, key_cache, value_cache) -> torch.Tensor:
        if chunk.block_ids is not None:
            cached = (-1, self.num_kv_heads, self.head_dim)
            k = key_cache.index_select(0, chunk.block_ids).view(cached)[: chunk.seq_len]
            v = value_cache.index_select(0, chunk.block_ids).view(cached)[: chunk.seq_len]
        # [1, heads, tokens, head_dim]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        return out.squeeze(0).transpose(0, 1)
