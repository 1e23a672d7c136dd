"""Rotary position embedding (RoPE) with a precomputed cos/sin cache, in Hugging Face's
"rotate half" layout, or on interleaved pairs (DeepSeek's `rope_interleave`: pairs (x0, x1),
(x2, x3), ... each rotated by one frequency, written back as [evens | odds] as transformers does).
Scaling: default, linear, llama3 and yarn (with its attention factor on cos/sin). A
`partial_rotary_factor` (GLM-4.5) rotates the first head_dim * factor features of each head and
passes the rest through."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmctl.engine.errors import UnsupportedArchitectureError
from llmctl.engine.forward_context import pass_memo

_SUPPORTED = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict:
    """The rope settings whichever transformers version wrote the config."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = factor
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _inv_freq(dim: int, params: dict, max_position: int) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "yarn":
        inv_freq = _yarn_inv_freq(dim, base, params, max_position)
    elif kind == "linear":
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


def _yarn_factor(params: dict, max_position: int) -> tuple[float, float]:
    """(factor, original_max_position_embeddings) of a yarn config (DeepSeek-V3 may give the
    factor only as max_position_embeddings over the original length)."""
    original = float(params.get("original_max_position_embeddings") or max_position)
    factor = params.get("factor")
    return (float(factor) if factor is not None else max_position / original), original


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, params: dict, max_position: int) -> torch.Tensor:
    """YaRN: interpolated frequencies below the correction range, extrapolated above it, a
    linear ramp between (transformers' _compute_yarn_parameters)."""
    factor, original = _yarn_factor(params, max_position)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(params: dict, max_position: int) -> float:
    """The factor a rope type multiplies cos and sin by: yarn's mscale ratio, else 1."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, _ = _yarn_factor(params, max_position)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, interleaved: bool = False):
        super().__init__()
        self.head_dim = head_dim
        # the features of each head that rotate (GLM-4.5: the first half)
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        self.interleaved = interleaved
        inv_freq = _inv_freq(self.rotary_dim, params, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(params, max_position)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

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

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
        cos, sin = self._cos_sin(positions, q.dtype)
        if self.rotary_dim == self.head_dim and not self.interleaved:
            return _apply(q, cos, sin), _apply(k, cos, sin)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rotated = _apply_interleaved(x[..., :rd], cos, sin) if self.interleaved else None
        if rotated is None:
            rotated = _apply(x[..., :rd], cos, sin)
        if rd == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., rd:]), dim=-1)


def _apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) rotated by frequency i, out as [evens | odds] (transformers'
    apply_rotary_pos_emb_interleave): q and k agree on the order, so their dot products do."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
