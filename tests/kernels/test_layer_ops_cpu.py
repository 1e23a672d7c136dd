"""The C++ layer ops on the CPU (kernels/cpu/layer_ops.py): RMSNorm with its residual add, RoPE
and SiLU-and-mul, against float64 references and against the torch code the layers run without
them, on odd shapes (widths that leave a tail after the 8-lane loops, a head_dim of 18, a token
stride wider than the heads). In bfloat16 they must give torch's bits (each op's output rounded
where torch rounds it); in float32 RoPE and SiLU too, RMSNorm up to its sum's order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.engine.kernels.cpu import layer_ops
from llmctl.engine.layers.layernorm import RMSNorm
from llmctl.engine.layers.rotary_embedding import RotaryEmbedding

OPS = layer_ops.ops_for(torch.zeros(1))
pytestmark = pytest.mark.skipif(OPS is None, reason="no C++ compiler for the CPU kernels")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def torch_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """layernorm.py's torch code."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * y.to(x.dtype)


def random(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, width", [(1, 77), (13, 576), (300, 20)])
def test_rms_norm_with_and_without_residual(dtype, rows, width):
    x, r = random(rows, width, dtype=dtype), random(rows, width, dtype=dtype, seed=1)
    w = (torch.rand(width, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    out = OPS.rms_norm(x, w, EPS)
    fused, res = OPS.fused_add_rms_norm(x, r, w, EPS)
    assert torch.equal(res, x + r)
    x64, s64 = x.double(), (x + r).double()
    for got, source in ((out, x64), (fused, s64)):
        want = w.double() * source / (source.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
        rel = 1e-5 if dtype == torch.float32 else 2.0**-7  # two bfloat16 roundings
        assert ((got.double() - want).abs() <= rel * want.abs() + 1e-6).all()
    if dtype == torch.bfloat16:
        assert torch.equal(out, torch_norm(x, w))
        assert torch.equal(fused, torch_norm(x + r, w))
    else:
        assert torch.allclose(out, torch_norm(x, w), rtol=1e-6, atol=1e-6)
    module = RMSNorm(width, EPS).to(dtype)
    module.weight.data.copy_(w)
    assert torch.equal(module(x), out)  # the layer runs the op
    assert all(torch.equal(a, b) for a, b in zip(module(x, r), (fused, res), strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [18, 64])
def test_rope_matches_torch_and_float64(dtype, head_dim):
    tokens, heads, kv_heads = 11, 5, 2
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    width = (heads + 2 * kv_heads) * head_dim + 3  # a token stride wider than its heads
    qkv = random(tokens, width, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(3))
    before = qkv.clone()
    got_q, got_k = q.clone(), k.clone()
    OPS.rotary_embedding_(positions, got_q, got_k, rotary.cos_cache, rotary.sin_cache)
    cos = rotary.cos_cache[positions].unsqueeze(1).to(dtype)
    sin = rotary.sin_cache[positions].unsqueeze(1).to(dtype)
    half = head_dim // 2
    for got, x in ((got_q, q), (got_k, k)):
        torch_rope = x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
        assert torch.equal(got, torch_rope)
        x64, c64, s64 = x.double(), cos.double(), sin.double()
        want = x64 * c64 + torch.cat((-x64[..., half:], x64[..., :half]), -1) * s64
        tolerance = 1e-6 if dtype == torch.float32 else 2.0**-6
        assert ((got.double() - want).abs() <= tolerance * (x64.abs().amax(-1, True) + 1)).all()
    # the layer rotates the views in place, in qkv: the rest of each row (v, the padding) kept
    rotated = rotary(positions, q, k)
    assert rotated[0] is q and rotated[1] is k
    assert torch.equal(q, got_q) and torch.equal(k, got_k)
    rest = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, rest:], before[:, rest:])
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        OPS.rotary_embedding_(positions + 4096, q, k, rotary.cos_cache, rotary.sin_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inner", [(1, 13), (7, 1536), (300, 24)])
def test_silu_and_mul(dtype, rows, inner):
    gu = random(rows, 2 * inner, dtype=dtype) * 4
    got = OPS.silu_and_mul(gu)
    gate, up = gu[:, :inner], gu[:, inner:]
    if inner % 16 == 0:  # torch's own vector loop over whole rows: SLEEF's exp, ours
        assert torch.equal(got, F.silu(gate) * up)
    else:  # torch takes libm's exp for a row's tail: 1 ulp apart at most
        assert torch.allclose(got, F.silu(gate) * up, rtol=2.4e-7 if dtype == torch.float32 else 0)
    g64 = gate.double()
    want = g64 / (1 + torch.exp(-g64)) * up.double()
    rel = 1e-6 if dtype == torch.float32 else 2.0**-7
    assert ((got.double() - want).abs() <= rel * want.abs() + 1e-6).all()


def test_bfloat16_silu_and_mul_for_every_gate_value():
    """bfloat16 silu is a table of all 65536 gates (layer_ops_cpu.h): each entry, ±0, the
    subnormals, ±inf and the NaNs included, gives torch's bits, and a row's tail reads it too."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = random(2, 65536, dtype=torch.bfloat16, seed=4) * 4
    gu = torch.cat([every.expand(2, -1), up], dim=1)
    got, want = OPS.silu_and_mul(gu), F.silu(every) * up
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().sum() == want.isnan().sum() > 0
    tail = torch.cat([gu[:, 65536 - 21 : 65536], gu[:, -21:]], dim=1)  # 21: 16 + 5 over
    torch.testing.assert_close(OPS.silu_and_mul(tail), got[:, -21:], rtol=0, atol=0, equal_nan=True)


def test_other_dtypes_and_devices_take_the_torch_code():
    assert layer_ops.ops_for(torch.zeros(2, dtype=torch.float64)) is None
    assert layer_ops.ops_for(torch.zeros(2, dtype=torch.float16)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 37, 49155])
def test_argmax_rows_is_torchs_argmax(vocab, dtype):
    logits = random(9, vocab, dtype=dtype)
    if vocab > 1:
        logits[1, vocab // 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first
        logits[2, vocab - 1] = float("nan")  # a NaN counts as the largest
        logits[2, vocab // 3] = float("nan")
        logits[3, 0] = -0.0  # equal to 0.0: the first of them
        logits[3, 1:] = torch.minimum(logits[3, 1:], torch.tensor(0.0))
    logits[4] = float("-inf")
    got = OPS.argmax_rows(logits)
    assert got.dtype == torch.int64
    # bfloat16: the argmax of the float32 values it holds (ties included)
    assert torch.equal(got, logits.float().argmax(dim=-1))
