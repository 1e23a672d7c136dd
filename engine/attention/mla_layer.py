"""MLAAttention: multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

    attn = MLAAttention(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                        kv_lora_rank, scale, kv_b_proj)          # in the model's __init__
    out = attn(q, latent, k_pe)                                   # in its forward

The cache of one layer is [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: per token
the normalized latent and the rope key, one "head" every query head reads (no separate K and V:
what makes the cache of these models small). Token t of a sequence lives in slot
block_table[t // block_size] * block_size + t % block_size, as for Attention.

kv_b_proj (a ColumnParallelLinear the model owns, kept in float and unpacked) holds this rank's
heads' [W_UK; W_UV] rows: for head h, rows h * (nope + v) .. + nope expand the latent into the
head's key (W_UK), the next v rows into its value (W_UV). Two ways to attend with them:
- expanded (prefill): keys and values of every position the chunk sees are expanded from the
  latent, and attention runs as multi-head attention with query/key head qk_nope + qk_rope and
  value head v (as transformers computes it);
- absorbed (decode): W_UK is folded into the query (q_latent = q_nope W_UK, per head) and W_UV
  into the output, so attention runs as multi-query attention straight over the cached rows,
  scores q_latent . latent + q_pe . k_pe, values the latent: kv_lora_rank + qk_rope_head_dim
  multiply-adds a cached token and head instead of expanding every cached token.
The model runner binds the cache and its one MLA backend (attention/selector.py); the backend
chooses the path (attention/backends/mla_torch.py).
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.engine.forward_context import get_attn_metadata


class MLAAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        kv_b_proj: nn.Module,
    ):
        super().__init__()
        self.num_heads = num_heads  # this rank's
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        # A reference, not a submodule: the model's attention owns (and loads) kv_b_proj.
        self.__dict__["kv_b_proj"] = kv_b_proj
        self.kv_cache = torch.empty(0, 1, self.latent_dim)
        self.backend = None
        self.kv_cache_group = 0  # MLA models have one KV cache group

    @property
    def latent_dim(self) -> int:
        """Values a token holds in the cache: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.latent_dim)

    def bind(self, kv_cache: torch.Tensor, backend, group: int = 0) -> None:
        """`group`: the KV cache group (core/kv_cache_layout.py); MLA models have one."""
        self.kv_cache = kv_cache
        self.backend = backend
        self.kv_cache_group = group

    # -- the two ways through kv_b_proj ---------------------------------------------------------

    def kv_b_weight(self) -> torch.Tensor:
        """[num_heads, nope + v, kv_lora_rank]: this rank's W_UK and W_UV rows, head by head."""
        weight = self.kv_b_proj.weight
        return weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, num_heads, nope] -> q_latent [T, num_heads, kv_lora_rank] (q_nope W_UK)."""
        w_uk = self.kv_b_weight()[:, : self.qk_nope_head_dim]  # [H, nope, L]
        return torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """o_latent [T, num_heads, kv_lora_rank] -> [T, num_heads, v] (o_latent W_UV^T)."""
        w_uv = self.kv_b_weight()[:, self.qk_nope_head_dim :]  # [H, v, L]
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2).to(o_latent.dtype))
        return out.transpose(0, 1)

    def expand_kv(self, latent: torch.Tensor, k_pe: torch.Tensor):
        """latent [S, kv_lora_rank], k_pe [S, rope] -> keys [S, H, nope + rope], values
        [S, H, v]: what transformers' expand_kv computes."""
        kv = self.kv_b_proj(latent).view(
            -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        return k, v

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads, nope + rope] (rope applied), latent [T, kv_lora_rank] (normalized),
        k_pe [T, rope] (rope applied) -> [T, num_heads * v_head_dim]."""
        if self.backend is None:
            raise RuntimeError("MLAAttention ran before the model runner bound its KV cache")
        out = self.backend.forward(self, q, latent, k_pe, get_attn_metadata())
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"rope={self.qk_rope_head_dim}, nope={self.qk_nope_head_dim}, v={self.v_head_dim}"
        )
