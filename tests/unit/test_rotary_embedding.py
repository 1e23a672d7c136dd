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

    with set_forward_context(object()):
        at_zero = rope(static_positions, q, k)
    static_positions.copy_(torch.tensor([5, 6, 7]))
    with set_forward_context(object()):
        moved = rope(static_positions, q, k)

    fresh = rope(torch.tensor([5, 6, 7]), q, k)  # outside any pass: nothing memoized
    assert torch.equal(moved[0], fresh[0]) and torch.equal(moved[1], fresh[1])
    assert not torch.allclose(moved[0], at_zero[0])


def test_layers_of_one_pass_share_one_lookup():
    rope = RotaryEmbedding(head_dim=8, max_position=64, params=PARAMS)
    positions = torch.tensor([1, 2])
    with set_forward_context(object()):
        first = rope._cos_sin(positions, torch.float32)
        second = rope._cos_sin(positions, torch.float32)
    assert first[0] is second[0] and first[1] is second[1]
