"""RotaryEmbedding looks up the cos/sin rows of a pass's positions once per forward pass, shared
by the pass's layers, and never across passes: a CUDA graph's static positions buffer is the same
tensor object in every pass, with new values copied in before each replay."""

from __future__ import annotations

import torch

from llmctl.engine.forward_context import set_forward_context
from llmctl.engine.layers.rotary_embedding import RotaryEmbedding

PARAMS = {"rope_theta": 10000.0, "rope_type": "default"}


def test_a_pass_reads_the_positions_its_static_buffer_holds_now():
    rope = RotaryEmbedding(head_dim=8, max_position=64, params=PARAMS)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    static_positions = torch.zeros(3, dtype=torch.int64)  # as a captured graph's input

    # each call its own q and k: where a kernel runs (the CPU's, the GPU's) they rotate in place
    with set_forward_context(object()):
        at_zero = rope(static_positions, q.clone(), k.clone())
    static_positions.copy_(torch.tensor([5, 6, 7]))
    with set_forward_context(object()):
        moved = rope(static_positions, q.clone(), k.clone())

    fresh = rope(torch.tensor([5, 6, 7]), q.clone(), k.clone())  # outside any pass: no memo
    assert torch.equal(moved[0], fresh[0]) and torch.equal(moved[1], fresh[1])
    assert not torch.allclose(moved[0], at_zero[0])


def test_layers_of_one_pass_share_one_lookup():
    rope = RotaryEmbedding(head_dim=8, max_position=64, params=PARAMS)
    positions = torch.tensor([1, 2])
    with set_forward_context(object()):
        first = rope._cos_sin(positions, torch.float32)
        second = rope._cos_sin(positions, torch.float32)
    assert first[0] is second[0] and first[1] is second[1]


def test_yarn_matches_transformers_frequencies_and_attention_factor():
    """DeepSeek-V3's YaRN (factor 40 over 4096 positions, mscale 1 / 1) and one whose mscale
    differs from mscale_all_dim (an attention factor other than 1): transformers' own numbers."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmctl.engine.layers.rotary_embedding import rope_parameters

    for mscale in (1.0, 0.707):
        scaling = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
                   "beta_slow": 1, "mscale": mscale, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096}  # fmt: skip
        config = DeepseekV3Config(
            qk_rope_head_dim=64, max_position_embeddings=8192, rope_parameters=scaling
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        rope = RotaryEmbedding(64, 8192, rope_parameters(config))
        positions = torch.arange(8192, dtype=torch.float32)
        emb = torch.outer(positions, inv_freq)
        torch.testing.assert_close(rope.cos_cache[:, :32], emb.cos() * factor)
        torch.testing.assert_close(rope.sin_cache[:, :32], emb.sin() * factor)


def test_interleaved_and_partial_rotation_match_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 17])
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    hf_q, hf_k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, tokens, dim]
    rope = RotaryEmbedding(16, 64, PARAMS, interleaved=True)
    cos, sin = rope.cos_cache[positions][None], rope.sin_cache[positions][None]
    want = apply_rotary_pos_emb_interleave(hf_q, hf_k, cos, sin)
    got = rope(positions, q, k)
    torch.testing.assert_close(got[0], want[0][0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1][0].transpose(0, 1), rtol=0, atol=0)
    # GLM-4.5: the first half of each head rotates, the rest passes through
    half = RotaryEmbedding(16, 64, {**PARAMS, "partial_rotary_factor": 0.5})
    assert half.rotary_dim == 8
    cos, sin = half.cos_cache[positions][None], half.sin_cache[positions][None]
    want = apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
    got = half(positions, q, k)
    torch.testing.assert_close(got[0], want[0][0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1][0].transpose(0, 1), rtol=0, atol=0)
