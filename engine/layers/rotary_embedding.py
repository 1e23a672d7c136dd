"""Rotary position embedding (RoPE) with a precomputed cos/sin cache, in Hugging Face's
"rotate half" layout, or on interleaved pairs (DeepSeek's `rope_interleave`: pairs (x0, x1),
(x2, x3), ... each rotated by one frequency, written back as [evens | odds] as transformers does),
computed as transformers computes it (float32 frequencies and tables).

Scaling: default, linear, llama3, yarn (gpt-oss, DeepSeek-V3: NTK-by-parts frequencies, cos and
sin scaled by its attention factor, DeepSeek's mscale ratio) and longrope (Phi-3: per-frequency
short and long factors). A `partial_rotary_factor` below 1 (GLM-4.5, Phi-4) rotates the first
dims of each head and passes the rest. Models
with a rope per layer type (Gemma 3: local base 10,000 on sliding layers, global 1,000,000 on
full ones) make one instance per type (`rope_parameters(config, layer_type)`).

LongRoPE uses its long factors for a request longer than original_max_position_embeddings and
its short ones otherwise, for every token of the request, as transformers generates one
sequence: there the whole KV cache is computed again with the long factors when the sequence
crosses that length, and the scheduler does the same (engine/core/scheduler.py,
`long_rope_threshold`). The model runner says per token which table it reads
(AttentionMetadata.long_rope).

On the GPU one Triton kernel rotates the query and key heads in place where the rotation is the
plain one (the whole head, rotate-half, one table: layers/fused_kernels.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmctl.engine.config.rope_parameters import long_rope_threshold, rope_parameters
from llmctl.engine.errors import UnsupportedArchitectureError
from llmctl.engine.forward_context import get_attn_metadata, pass_memo
from llmctl.engine.kernels.cpu import layer_ops
from llmctl.engine.layers.fused_kernels import kernel_ops, use_fused_kernels

_SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")
__all__ = ["RotaryEmbedding", "get_rope", "long_rope_threshold", "rope_parameters", "yarn_mscale"]


def get_rope(head_dim: int, max_position: int, params: dict) -> RotaryEmbedding:
    if params["rope_type"] == "longrope":
        return LongRopeRotaryEmbedding(head_dim, max_position, params)
    return RotaryEmbedding(head_dim, max_position, params)


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _inv_freq(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2], the factor cos and sin are scaled by), as transformers'
    ROPE_INIT_FUNCTIONS compute them."""
    base = float(params["rope_theta"])
    inv_freq = _base_inv_freq(dim, base)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, base, params, max_position)
    raise UnsupportedArchitectureError(
        f"rope scaling type {kind!r} is not supported",
        f"supported rope types: {', '.join(_SUPPORTED)}",
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    dim: int, base: float, params: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies interpolated by `factor` below the beta_slow rotations, kept above
    beta_fast, ramped between; cos and sin scaled by 0.1 ln(factor) + 1 (or the config's; with
    DeepSeek's mscale and mscale_all_dim, their ratio). A config may give the factor only as
    max_position_embeddings over the original length (DeepSeek-V3)."""
    original = float(params.get("original_max_position_embeddings") or max_position)
    factor = float(params.get("factor") or max_position / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(
                factor, float(mscale_all_dim)
            )
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _tables(inv_freq: torch.Tensor, max_position: int, scale: float):
    """cos and sin [max_position, 2 * len(inv_freq)] (the frequencies twice), times `scale`."""
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, interleaved: bool = False):
        super().__init__()
        self.head_dim = head_dim
        # the features of each head that rotate (GLM-4.5: the first half)
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        self.interleaved = interleaved
        self.max_position = max_position
        cos, sin = self._make_tables(params)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self._fused: bool | None = None  # decided at the first call (layers/fused_kernels.py)

    @property
    def plain(self) -> bool:
        """One cos/sin row per position over the whole head (what the fused decode stack
        reads)."""
        plain = type(self) is RotaryEmbedding and self.rotary_dim == self.head_dim
        return plain and not self.interleaved

    def _make_tables(self, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = _inv_freq(self.rotary_dim, params, self.max_position)
        return _tables(inv_freq, self.max_position, scale)

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # One instance serves every layer of a model (of a layer type), and a pass's layers share
        # one positions tensor: look the rows up once per forward pass, not once per layer. The
        # memo is the pass's own (a module attribute would outlive it: a CUDA graph captured
        # after an eager warm-up on the same inputs then replays that warm-up's freed tensors).
        memo = pass_memo()
        key = ("rotary", id(self), id(positions), dtype)
        hit = memo.get(key)
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
        rows = self._rows(positions)
        cos = self.cos_cache.index_select(0, rows).unsqueeze(1).to(dtype)
        sin = self.sin_cache.index_select(0, rows).unsqueeze(1).to(dtype)
        memo[key] = (positions, cos, sin)
        return cos, sin

    def _fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """q and k as the C++ op takes them: whole heads of this table's width, one dtype."""
        width = self.cos_cache.shape[1]
        return k.dtype == q.dtype and _heads_contiguous(q, width) and _heads_contiguous(k, width)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]. Where a
        kernel runs (the GPU's, the CPU's) q and k (views of the QKV projection's output) are
        rotated in place and returned."""
        if self._fused is None:
            self._fused = use_fused_kernels(q) and self.plain and q.shape[-1] == self.head_dim
        if self._fused:
            kernel_ops().rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
            return q, k
        ops = layer_ops.ops_for(q) if self.plain else None
        if ops is not None and self._fits(q, k):
            # on the CPU: one C++ pass per token (kernels/cpu/layer_ops.py), the same rounding,
            # in place as on the GPU
            ops.rotary_embedding_(positions, q, k, self.cos_cache, self.sin_cache)
            return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        if self.rotary_dim == self.head_dim and not self.interleaved:
            return _apply(q, cos, sin), _apply(k, cos, sin)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        apply = _apply_interleaved if self.interleaved else _apply
        rotated = apply(x[..., :rd], cos, sin)
        if rd == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., rd:]), dim=-1)


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """Phi-3's LongRoPE: rows [0, max_position) of the tables hold the short factors' angles,
    rows [max_position, 2 max_position) the long factors'; a token reads the long half when its
    request is longer than original_max_position_embeddings (AttentionMetadata.long_rope)."""

    def _make_tables(self, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or self.max_position / original
        scale = params.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        base = float(params["rope_theta"])
        halves = []
        for name in ("short_factor", "long_factor"):
            ext = torch.tensor(params[name], dtype=torch.float32)
            halves.append(_tables(1.0 / (ext * base**shape), self.max_position, float(scale)))
        return torch.cat([halves[0][0], halves[1][0]]), torch.cat([halves[0][1], halves[1][1]])

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        long_rope = get_attn_metadata().long_rope
        if long_rope is None:
            return positions
        return positions + long_rope[: positions.shape[0]] * self.max_position


def _apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) rotated by frequency i, out as [evens | odds] (transformers'
    apply_rotary_pos_emb_interleave): q and k agree on the order, so their dot products do."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _heads_contiguous(x: torch.Tensor, head_dim: int) -> bool:
    """[tokens, heads, head_dim] with each token's heads side by side (any token stride)."""
    return x.dim() == 3 and x.shape[2] == head_dim and x.stride(2) == 1 and x.stride(1) == head_dim


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
