"""TorchMLABackend: multi-head latent attention in plain torch (the CPU's MLA backend).

Cache write: index_copy_ of [latent | k_pe] rows at the step's slots. Decodes take the absorbed
path (attention/mla_layer.py): the query folded through W_UK, one multi-query SDPA over the
sequences' gathered latent rows (values: the rows' first kv_lora_rank features), the output
through W_UV. Prefill chunks take the expanded path: keys and values of the positions the chunk
sees (its own, plus the cached ones after a prefix-cache hit or an earlier chunk) expanded by
kv_b_proj, then SDPA with query/key head nope + rope and value head v, causal at the chunk's
offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmctl.engine.attention.backends.base import AttentionBackend
from llmctl.engine.attention.backends.torch_sdpa import _chunk_mask
from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk
from llmctl.engine.kernels.cpu.paged_attention_cpu import decode_sdpa_metadata


class TorchMLABackend(AttentionBackend):
    name = "torch-mla"

    def forward(self, layer, q, latent, k_pe, md: AttentionMetadata) -> torch.Tensor:
        """q [T, H, nope + rope], latent [T, kv_lora_rank], k_pe [T, rope] -> [T, H, v]."""
        self.write(layer.kv_cache, latent, k_pe, md.slot_mapping)
        d = md.num_decodes
        parts = []
        if d:
            parts.append(self.decode(layer, q[:d], md))
        for chunk in md.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            parts.append(self.prefill(layer, q[rows], latent[rows], k_pe[rows], chunk, md))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write(self, cache, latent, k_pe, slot_mapping) -> None:
        rows = torch.cat((latent, k_pe), dim=-1)  # [T, kv_lora_rank + rope]
        cache.view(-1, rows.shape[-1]).index_copy_(0, slot_mapping, rows)

    def decode(self, layer, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The absorbed path: [num_decodes, H, nope + rope] -> [num_decodes, H, v]."""
        q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)
        q_latent = torch.cat((layer.absorb_query(q_nope), q_pe), dim=-1)  # [B, H, L + rope]
        o_latent = self.attend_latent(
            q_latent, layer.kv_cache, md.decode_block_tables, md.decode_seq_lens, layer
        )
        return layer.expand_output(o_latent)

    def attend_latent(self, q_latent, cache, block_tables, seq_lens, layer) -> torch.Tensor:
        """Multi-query attention over each sequence's cached rows: [B, H, L + rope] ->
        [B, H, L], the rows' first L = kv_lora_rank features as values."""
        num_seqs, num_heads, width = q_latent.shape
        block_ids, bias = decode_sdpa_metadata(
            block_tables, seq_lens, cache.shape[1], None, q_latent.dtype
        )
        rows = cache.index_select(0, block_ids).view(num_seqs, 1, -1, width)
        out = F.scaled_dot_product_attention(
            q_latent.unsqueeze(1),  # [B, 1, H, L + rope]: the heads as one head's queries
            rows,
            rows[..., : layer.kv_lora_rank],
            attn_mask=bias,
            scale=layer.scale,
        )
        return out.view(num_seqs, num_heads, layer.kv_lora_rank)

    def prefill(self, layer, q, latent, k_pe, chunk: PrefillChunk, md) -> torch.Tensor:
        """The expanded path for one chunk: [query_len, H, nope + rope] -> [query_len, H, v]."""
        mask = None
        if chunk.context_len:
            mask = md.masks.get(chunk.index)
            if mask is None:
                mask = md.masks[chunk.index] = _chunk_mask(chunk, None, q.device)
            cache = layer.kv_cache
            num_blocks = -(-chunk.seq_len // cache.shape[1])
            block_ids = md.prefill_block_tables[chunk.index, :num_blocks]
            rows = cache.index_select(0, block_ids).view(-1, cache.shape[-1])[: chunk.seq_len]
            latent, k_pe = rows.split([layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
        k, v = layer.expand_kv(latent, k_pe)  # [S, H, nope + rope], [S, H, v]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=layer.scale,
        )
        return out.squeeze(0).transpose(0, 1)
