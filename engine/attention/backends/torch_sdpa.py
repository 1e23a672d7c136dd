"""TorchSDPABackend: paged attention in plain torch (index_copy_ writes, SDPA over gathered keys).

Decodes gather each sequence's blocks and run scaled_dot_product_attention with a padding mask;
prefill chunks run SDPA causal over their own keys, or over the gathered cache with an offset
causal mask after a prefix-cache hit or an earlier chunk. A layer's sliding window narrows the
mask. A layer's sinks (gpt-oss) join the softmax as one more key: zero key and value, its score
the head's sink logit, given through the additive mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmctl.engine.attention.backends.base import AttentionBackend
from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk
from llmctl.engine.kernels.cpu.paged_attention_cpu import paged_decode_attention_sdpa


class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def forward(self, layer, q, k, v, md: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = layer.kv_cache.unbind(0)
        self.write_cache(key_cache, value_cache, k, v, md.slot_mapping)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[: md.num_decodes] = self.decode(
                q[: md.num_decodes],
                key_cache,
                value_cache,
                md.decode_block_tables,
                md.decode_seq_lens,
                layer.scale,
                layer.sliding_window,
                layer.sinks,
            )
        if md.prefills:
            self.prefill(layer, q, k, v, md.prefills, md, key_cache, value_cache, out)
        return out

    def write_cache(self, key_cache, value_cache, k, v, slot_mapping) -> None:
        """The step's keys and values into their slots of the layer's paged caches."""
        flat_shape = (-1, *key_cache.shape[2:])
        key_cache.view(flat_shape).index_copy_(0, slot_mapping, k)
        value_cache.view(flat_shape).index_copy_(0, slot_mapping, v)

    def prefill(self, layer, q, k, v, chunks, md, key_cache, value_cache, out) -> None:
        """Each prefill chunk's attention into its rows of `out`."""
        for chunk in chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = _prefill(
                layer, q[rows], k[rows], v[rows], chunk, md, key_cache, value_cache
            )

    def decode(self, q, key_cache, value_cache, block_tables, seq_lens, scale, window, sinks):
        """[num_decodes, num_heads, head_dim]: one query per sequence over its paged keys."""
        return paged_decode_attention_sdpa(
            q, key_cache, value_cache, block_tables, seq_lens, scale, window, sinks
        )


def _prefill(layer, q, k, v, chunk: PrefillChunk, md, key_cache, value_cache) -> torch.Tensor:
    window = layer.sliding_window
    mask = None
    if chunk.context_len or layer.sinks is not None or (window and chunk.seq_len > window):
        key = (chunk.index, window)
        mask = md.masks.get(key)
        if mask is None:
            mask = md.masks[key] = _chunk_mask(chunk, window, q.device)
    if chunk.context_len:
        num_blocks = -(-chunk.seq_len // key_cache.shape[1])
        block_ids = md.prefill_block_tables[chunk.index, :num_blocks]
        cached = (-1, layer.num_kv_heads, layer.head_dim)
        k = key_cache.index_select(0, block_ids).view(cached)[: chunk.seq_len]
        v = value_cache.index_select(0, block_ids).view(cached)[: chunk.seq_len]
    # [1, heads, tokens, head_dim]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if layer.sinks is not None:
        k, v, mask = with_sink_key(k, v, mask, layer.sinks, layer.num_heads)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=layer.group > 1,
    )
    return out.squeeze(0).transpose(0, 1)


def with_sink_key(
    k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [1, kv_heads, keys, head_dim] and a bool mask [queries, keys] -> k and v with a zero
    row appended and an additive float mask [1, num_heads, queries, keys + 1] whose last column
    is each head's sink: softmax then weighs exp(sink) against the keys, and the zero value adds
    nothing."""
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[-1])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    bias = torch.zeros(mask.shape, dtype=k.dtype, device=k.device)
    bias.masked_fill_(~mask, float("-inf"))
    sink = sinks.to(k.dtype).view(1, num_heads, 1, 1).expand(1, num_heads, mask.shape[0], 1)
    return k, v, torch.cat([bias.expand(1, num_heads, *mask.shape), sink], dim=-1)


def _chunk_mask(chunk: PrefillChunk, window: int | None, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True = attend: causal at an offset, within the window."""
    q_pos = torch.arange(chunk.context_len, chunk.seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(chunk.seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
