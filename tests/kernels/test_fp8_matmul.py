"""The block-FP8 matmuls against float64 references: the CPU kernel (weight-only; its dequantized
rows bit for bit the checkpoint's fp8 * scale_inv, subnormals and negative zero included) and
the Triton W8A8 GEMM (activations quantized per token and group of 128), which runs in Triton's
interpreter without a GPU: FP8 loads, the activations' scales and FP8 tl.dot are checked there;
the tensor cores' own accumulation precision and speed are not. Triton 3.9's interpreter rounds
float32 -> float8e4nv wrongly where the rounding carries into the exponent (127 -> 64, not 128):
on the CPU the activations' FP8 values are held to torch's everywhere else, and to exactly that
error there; on a GPU to torch's everywhere."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.kernels.cpu import fp8_matmul
from llmctl.engine.kernels.cpu.fp8_matmul import Fp8LinearWeight, dequantize_fp8
from llmctl.engine.layers.quantization.fp8 import (
    dequantize_blocks,
    packed_weight,
    quantize_blocks,
    quantize_rows,
)

# [N, K]: partial blocks along both (200 = 128 + 72; 300 rows = 2 blocks + 44), one K under 8
SHAPES = [(96, 200), (300, 576), (64, 128), (5, 7)]


def weight(n: int, k: int) -> Fp8LinearWeight:
    g = torch.Generator().manual_seed(n * k)
    q, scale_inv = quantize_blocks(torch.randn(n, k, generator=g) * 3, (128, 128))
    bits = q.view(torch.uint8)
    bits[0, : min(k, 6)] = torch.tensor([0, 1, 7, 0x80, 0x81, 0x7E], dtype=torch.uint8)[: min(k, 6)]
    return packed_weight(q, scale_inv, 0, (128, 128))


@pytest.mark.parametrize("n, k", SHAPES)
def test_cpu_rows_are_the_checkpoints_products_bit_for_bit(n, k):
    w = weight(n, k)
    reference = (
        w.qweight.view(torch.float8_e4m3fn).float() * w.scales.repeat_interleave(128, 1)[:, :k]
    )
    assert fp8_matmul.kernel_available()
    assert torch.equal(w.dequantize(), reference)
    assert torch.equal(w.dequantize(3, 5), reference[3:5])


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 24, 40])  # the decode kernel up to 24 rows, tiles above
def test_cpu_matmul_is_x_times_the_dequantized_weight(n, k, m):
    w = weight(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(w.matmul(x).double(), want, atol=1e-4, rtol=1e-4)


def test_the_torch_fallback_computes_the_same(monkeypatch):
    w = weight(96, 200)
    x = torch.randn(3, 200)
    kernel = w.matmul(x)
    monkeypatch.setattr(fp8_matmul, "_kernel", lambda: None)
    torch.testing.assert_close(w.matmul(x), kernel, atol=1e-5, rtol=1e-5)
    assert torch.equal(w.dequantize(), dequantize_fp8(w.qweight, w.scales, 128))


def test_block_round_trip_and_row_slices_keep_their_block_scales():
    w = torch.randn(300, 200)
    q, scale_inv = quantize_blocks(w, (128, 128))
    assert scale_inv.shape == (3, 2)
    back = dequantize_blocks(q, scale_inv, (128, 128))
    step = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200] * 2**-9
    # e4m3: 3 mantissa bits (half a step: 2^-4 of the value), subnormals 2^-9 apart
    assert ((back - w).abs() <= w.abs() * 2**-4 + step / 2).all()
    whole = packed_weight(q, scale_inv, 0, (128, 128)).dequantize()
    part = packed_weight(q[128:300], scale_inv[1:], 128, (128, 128)).dequantize()
    assert torch.equal(part, whole[128:300])  # a rank's rows, from its block rows' scales
    assert torch.equal(quantize_rows(w, (128, 128)).dequantize(), whole)


@pytest.mark.parametrize("m, n, k", [(1, 96, 200), (5, 300, 576), (40, 64, 128), (3, 130, 130)])
def test_triton_gemm_is_the_quantized_activations_times_the_weight(m, n, k, device):
    from llmctl.engine.kernels.triton.triton_fp8_gemm import fp8_block_mm, per_token_group_quant

    w = weight(n, k).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    xq, xs = per_token_group_quant(x, 128)
    # the activations' FP8: torch's round-to-nearest of x / (max|group| / 448)
    groups = torch.nn.functional.pad(x.cpu(), (0, -k % 128)).view(m, -1, 128)
    scales = groups.abs().amax(-1).clamp(min=1e-10) / 448
    torch.testing.assert_close(xs.cpu(), scales, rtol=1e-6, atol=0)
    want_q = (groups / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_q = want_q.view(m, -1)[:, :k].float()
    got_q = xq.cpu().float()
    if device.type == "cuda":
        assert torch.equal(got_q, want_q)
    else:  # the interpreter's carry error only: half the magnitude torch rounds to
        wrong = got_q != want_q
        assert torch.equal(got_q[wrong] * 2, want_q[wrong])
    y = fp8_block_mm(x, w.qweight, w.scales, 128)
    xd = xq.cpu().float() * xs.cpu().repeat_interleave(128, 1)[:, :k]
    want = xd.double() @ w.dequantize().cpu().double().T
    torch.testing.assert_close(y.cpu().double(), want, atol=1e-4, rtol=1e-4)
