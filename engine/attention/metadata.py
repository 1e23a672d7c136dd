"""AttentionMetadata: one step's attention inputs, built once per step by the model runner.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).
Token t of a sequence lives in slot block_table[t // block_size] * block_size + t % block_size.

A step's tokens are laid out decodes first (one token per sequence), then prefill chunks (a run of
one sequence's tokens each; a chunk after a prefix-cache hit or an earlier chunk starts at
context_len > 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    # torch backends: a chunk's [query_len, seq_len] mask, built by the first layer needing it
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
