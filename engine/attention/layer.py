"""Paged attention: the KV cache write and attention over it, for decodes and prefill chunks.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).
Token t of a sequence lives in slot block_table[t // block_size] * block_size + t % block_size.

A step's tokens are laid out decodes first (one token per sequence), then prefill chunks (a run of
one sequence's tokens each; a chunk after a prefix-cache hit or an earlier chunk starts at
context_len > 0). Two backends behind one layer:
- triton (CUDA, the default there): reshape_and_cache, paged decode and prefill attention kernels
  (engine/kernels/triton/triton_attention.py), called through torch custom ops (triton_ops.py)
  so CUDA graphs capture them and device checks see them.
- torch (CPU, and CUDA when Triton is missing or LLMCTL_ATTENTION_BACKEND=torch): index_copy_
  writes, the fused C++ decode kernel on the CPU (gather + SDPA elsewhere), and SDPA for prefill
  chunks (causal over their own keys, or over the gathered cache with an offset causal mask).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.forward_context import get_attn_metadata
from llmctl.engine.kernels.cpu.paged_attention_cpu import paged_decode_attention


@dataclass
class PrefillChunk:
    """Host-side facts about one prefill chunk (Python ints: no device sync to read them)."""

    query_start: int  # index of the chunk's first token in the step's token layout
    query_len: int
    seq_len: int  # tokens in the sequence once this chunk is computed
    context_len: int  # tokens of the sequence already in the cache before this chunk
    index: int  # the chunk's row in the prefill_* tensors


@dataclass
class AttentionMetadata:
    """One step's attention inputs; every tensor is on the model's device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; negative: padding, not written
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, width] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, the new token included
    sliding_window: int | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, width] int64
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills + 1], from 0
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefills] int64
    prefill_context_lens: torch.Tensor | None = None  # [num_prefills] int64
    max_prefill_query_len: int = 0
    # torch backend: a chunk's [query_len, seq_len] mask, built by the first layer needing it
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """The backend for tensors on `device`: triton off the CPU, unless LLMCTL_ATTENTION_BACKEND
    says torch or triton (on the CPU only useful under TRITON_INTERPRET=1: the tests run the
    engine's Triton path through Triton's interpreter that way)."""
    choice = os.environ.get("LLMCTL_ATTENTION_BACKEND", "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        return triton_available()
    return device.type != "cpu" and triton_available()


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
        if use_triton(q.device):
            out = self._forward_triton(q, k, v, md, key_cache, value_cache)
        else:
            out = self._forward_torch(q, k, v, md, key_cache, value_cache)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    # -- triton ----------------------------------------------------------------------------------

    def _forward_triton(self, q, k, v, md: AttentionMetadata, key_cache, value_cache):
        from llmctl.engine.kernels.triton import triton_ops

        triton_ops.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping)
        d = md.num_decodes
        parts = []
        if d:
            parts.append(
                triton_ops.paged_decode_attention(
                    q[:d],
                    key_cache,
                    value_cache,
                    md.decode_block_tables,
                    md.decode_seq_lens,
                    self.scale,
                    md.sliding_window,
                )
            )
        if md.prefills:
            parts.append(
                triton_ops.prefill_attention(
                    q[d:],
                    key_cache,
                    value_cache,
                    md.prefill_block_tables,
                    md.prefill_query_start_loc,
                    md.prefill_seq_lens,
                    md.prefill_context_lens,
                    md.max_prefill_query_len,
                    self.scale,
                    md.sliding_window,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- torch -----------------------------------------------------------------------------------

    def _forward_torch(self, q, k, v, md: AttentionMetadata, key_cache, value_cache):
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        key_cache.view(flat_shape).index_copy_(0, md.slot_mapping, k)
        value_cache.view(flat_shape).index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[: md.num_decodes] = paged_decode_attention(
                q[: md.num_decodes],
                key_cache,
                value_cache,
                md.decode_block_tables,
                md.decode_seq_lens,
                self.scale,
                md.sliding_window,
            )
        for chunk in md.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], chunk, md, key_cache, value_cache)
        return out

    def _prefill(self, q, k, v, chunk: PrefillChunk, md, key_cache, value_cache) -> torch.Tensor:
        window = md.sliding_window
        mask = None
        if chunk.context_len or (window is not None and chunk.seq_len > window):
            mask = md.masks.get(chunk.index)
            if mask is None:
                mask = md.masks[chunk.index] = _chunk_mask(chunk, window, q.device)
        if chunk.context_len:
            num_blocks = -(-chunk.seq_len // key_cache.shape[1])
            block_ids = md.prefill_block_tables[chunk.index, :num_blocks]
            cached = (-1, self.num_kv_heads, self.head_dim)
            k = key_cache.index_select(0, block_ids).view(cached)[: chunk.seq_len]
            v = value_cache.index_select(0, block_ids).view(cached)[: chunk.seq_len]
        # [1, heads, tokens, head_dim]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        return out.squeeze(0).transpose(0, 1)


def _chunk_mask(chunk: PrefillChunk, window: int | None, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True = attend: causal at an offset, within the window."""
    q_pos = torch.arange(chunk.context_len, chunk.seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(chunk.seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
