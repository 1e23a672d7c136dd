"""The layers' fused Triton kernels (kernels/triton/triton_rms_norm.py, triton_rotary.py,
triton_activation.py) against the layers' own torch code, in float32 and float16, on rows of any
stride (views into a wider tensor, as the QKV projection's output is)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.engine.kernels.triton import triton_activation, triton_rms_norm, triton_rotary
from llmctl.engine.layers.layernorm import RMSNorm
from llmctl.engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters

DTYPES = [torch.float32, torch.float16]


def _torch_layer(module):
    module._fused = False  # the plain torch code, whatever the device
    return module


def _close(dtype):
    """float32: the rounding of a different summation order; float16: one rounding step."""
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1000])
def test_rms_norm_and_its_fused_residual_add(device, dtype, hidden):
    torch.manual_seed(0)
    norm = _torch_layer(RMSNorm(hidden, eps=1e-5)).to(device, dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    wide = torch.randn(7, hidden + 32, device=device, dtype=dtype)
    x = wide[:, :hidden]  # rows with a stride wider than the row
    residual = torch.randn(7, hidden, device=device, dtype=dtype)

    out = triton_rms_norm.rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(out, norm(x), **_close(dtype))

    expected, expected_residual = norm(x.clone(), residual.clone())
    triton_rms_norm.fused_add_rms_norm(x, residual, norm.weight, 1e-5)  # in place
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # one rounding
    torch.testing.assert_close(x, expected, **_close(dtype))
    assert torch.equal(wide[:, hidden:], wide[:, hidden:])  # (the columns beyond untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (8, 1, 64), (3, 3, 80)])
def test_rotary_rotates_views_of_qkv_in_place(device, dtype, heads, kv_heads, head_dim):
    torch.manual_seed(1)
    rope = _torch_layer(
        RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    )
    rope = rope.to(device)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 3, 100, 200, 300, 5, 511], device=device)
    v_before = v.clone()
    expected_q, expected_k = rope(positions, q.clone(), k.clone())

    triton_rotary.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache)

    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else _close(dtype)
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)
    assert torch.equal(v, v_before)  # the values beside them are not touched


def test_rotary_uses_the_llama3_scaled_table(device):
    params = rope_parameters(
        type("C", (), {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64},
                       "rope_theta": 500000.0})()
    )  # fmt: skip
    rope = _torch_layer(RotaryEmbedding(32, 256, params)).to(device)
    q = torch.randn(5, 2, 32, device=device)
    k = torch.randn(5, 1, 32, device=device)
    positions = torch.tensor([1, 60, 100, 200, 255], device=device)
    expected_q, expected_k = rope(positions, q.clone(), k.clone())
    triton_rotary.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 1536, 2500])
def test_silu_and_mul(device, dtype, d):
    torch.manual_seed(2)
    x = torch.randn(6, 2 * d, device=device, dtype=dtype) * 3
    expected = F.silu(x[:, :d]) * x[:, d:]
    torch.testing.assert_close(triton_activation.silu_and_mul(x), expected, **_close(dtype))
