"""Rotary position embedding (RoPE) with a precomputed cos/sin cache, in Hugging Face's
"rotate half" layout. Scaling: default, linear and llama3."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmctl.engine.errors import UnsupportedArchitectureError
from llmctl.engine.forward_context import pass_memo
from llmctl.engine.kernels.cpu import layer_ops

_SUPPORTED = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict:
    """The rope settings whichever transformers version wrote the config."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _inv_freq(dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise UnsupportedArchitectureError(
            f"rope scaling type {kind!r} is not supported",
            f"supported rope types: {', '.join(_SUPPORTED)}",
        )
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, params)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # One instance serves every layer of a model, and a pass's layers share one positions
        # tensor: look the rows up once per forward pass, not once per layer. The memo is the
        # pass's own (a module attribute would outlive it: a CUDA graph captured after an eager
        # warm-up on the same inputs then replays that warm-up's freed cos/sin tensors).
        memo = pass_memo()
        key = ("rotary", id(self), id(positions), dtype)
        hit = memo.get(key)
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1).to(dtype)
        memo[key] = (positions, cos, sin)
        return cos, sin

    def _fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """q and k as the C++ op takes them: whole heads of this table's width, one dtype."""
        width = self.cos_cache.shape[1]
        return k.dtype == q.dtype and _heads_contiguous(q, width) and _heads_contiguous(k, width)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
        ops = layer_ops.ops_for(q)
        if ops is not None and self._fits(q, k):
            # on the CPU: one C++ pass per token (kernels/cpu/layer_ops.py), the same rounding
            return ops.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
        cos, sin = self._cos_sin(positions, q.dtype)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _heads_contiguous(x: torch.Tensor, head_dim: int) -> bool:
    """[tokens, heads, head_dim] with each token's heads side by side (any token stride)."""
    return x.dim() == 3 and x.shape[2] == head_dim and x.stride(2) == 1 and x.stride(1) == head_dim


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
