"""Prefill GEMMs on int8 activations and AVX512-VNNI (int8_gemm.cpp): the linear, the gated MLP
and the linears with RoPE or the residual add and RMSNorm in their pass, and the layers that take
them on the CPU path with int8_prefill (Zen 4).

The kernels define their numerics (int8_gemm.cpp's header): each row of x quantized per block of
32 values, s = amax / 127 and a = round(x * (127 / amax)) in float32, and y = x^ W^T for
x^ = s a, W the packed weight's own values. The reference computes exactly that in float64; the
kernel may differ by its float32 sums and the output's rounding to bfloat16. The fused ops must
give the unfused int8 ops' bits (the same sums, then the row code every path runs).
These run wherever the CPU has AVX512-VNNI (the Intel AMX kind too, by calling the ops); the
layers' tests need the int8 path to be the one the engine takes.
"""

from __future__ import annotations

import pytest
import torch
from quantized_layers import packed, quantized_mlp

from llmctl.engine.kernels.cpu import quantized_matmul as kernels
from llmctl.engine.layers import gated_mlp
from llmctl.engine.layers.activation import SiluAndMul
from llmctl.engine.platform import cpu_flags


@pytest.fixture(scope="module")
def int8():
    op = kernels.build_kernel()
    if not op.int8_built():
        have = "AVX512-VNNI" if "avx512_vnni" in cpu_flags() else "no AVX512-VNNI"
        pytest.skip(f"this build has no int8 GEMM (the CPU has {have}, or an older -march)")
    return op


@pytest.fixture(scope="module")
def int8_path(int8):
    if kernels.prefill_gemm(int8) != "int8":
        pytest.skip("the engine's prefill GEMM here is not int8 (an AMX CPU, or one without VNNI)")
    return int8


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x^ = s a, float64: each block of 32 values quantized as the kernels do it."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as one float32 division (`127.0 / tensor` is 127 * (1 / tensor) in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    a = torch.round(blocks * inv)  # float32 product, rounded half to even
    return (a.double() * (amax / 127.0).double()).reshape(x.shape)


def assert_int8_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x^ W^T in float64 (W [N, K] float), up to float32 sums and y's rounding."""
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    xq = quantized_activations(x)
    expected = xq @ w.double().T
    magnitude = xq.abs() @ w.double().abs().T
    bound = 2.0**-8 * expected.abs() + 1e-5 * magnitude
    worst = ((y.double() - expected).abs() - bound).max().item()
    assert worst <= 0, f"an output is {worst:.3g} past its bound"


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with what quantization meets: a block of zeros, an outlier, tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0
    if m > 2:
        x[1, 5] = 300.0
        x[2] *= 1e-3
    return x.bfloat16()


@pytest.mark.parametrize(
    "bits, group, m, n, k",
    [
        (4, 32, 1, 32, 32),
        (4, 32, 37, 64, 96),
        (4, 64, 300, 96, 576),
        (4, 128, 7, 32, 256),
        (8, 32, 37, 64, 96),
        (8, 128, 300, 32, 256),
    ],
)
def test_int8_linear_gives_the_quantized_activations_times_w(int8, bits, group, m, n, k):
    w = packed(bits, group, n, k, seed=m + n + k)
    x = activations(m, k, seed=m)
    y = int8.int8_linear(x, int8.int8_blocks(w.qweight, w.scales, w.zeros, bits, group, 0))
    assert_int8_product(y, x, w.dequantize())


def test_the_error_is_the_activations_quantization(int8):
    """Against the bfloat16 product the int8 output differs by what quantizing x costs: less than
    one step s / 2 per value (times |W|), and far more than float32 sums would."""
    w = packed(4, 32, 64, 576, seed=3)
    x = activations(64, 576, seed=4)
    y = int8.int8_linear(x, int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 0)).double()
    exact = x.double() @ w.dequantize().double().T
    step = x.float().reshape(64, -1, 32).abs().amax(-1) / 127  # s per block
    half_steps = step.double().repeat_interleave(32, dim=1) / 2
    bound = half_steps @ w.dequantize().double().abs().T + 2.0**-8 * exact.abs()
    assert ((y - exact).abs() <= bound).all()
    assert (y - exact).abs().max() > 1e-3 * exact.abs().max()  # not the float path's numbers


def test_gate_up_halves_put_gate_and_up_columns_side_by_side(int8):
    w = packed(4, 32, 128, 96, seed=5)
    x = activations(40, 96, seed=6)
    plain = int8.int8_linear(x, int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 0))
    halves = int8.int8_linear(x, int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 64))
    # panel p: gate columns 16 p .. 16 p + 15, then up columns 64 + 16 p ..
    order = torch.cat(
        [torch.cat([torch.arange(16) + 16 * p, torch.arange(16) + 64 + 16 * p]) for p in range(4)]
    )
    assert torch.equal(halves, plain[:, order])


def test_int8_blocks_refuse_what_they_cannot_lay_out(int8):
    w = packed(4, 32, 48, 64, seed=1)
    with pytest.raises(RuntimeError, match="N must be a multiple of 32"):
        int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 0)
    w = packed(4, 32, 64, 64, seed=1)
    with pytest.raises(RuntimeError, match="gate_up_half must be half of N"):
        int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 24)
    w8 = packed(8, 16, 32, 64, seed=1)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 32"):
        int8.int8_blocks(w8.qweight, w8.scales, None, 8, 16, 0)
    blocks = int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 0)
    with pytest.raises(RuntimeError, match="w must be int8_blocks' \\[N / 32, 40 K\\] bytes"):
        int8.int8_linear(torch.randn(8, 96).bfloat16(), blocks)
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        int8.int8_linear(torch.randn(8, 64), blocks)


@pytest.mark.parametrize("m, h, i", [(1, 64, 96), (37, 96, 160), (300, 64, 128)])
def test_int8_gated_mlp_gives_the_unfused_int8_layers_bits(int8, m, h, i):
    gu, dn = packed(4, 32, 2 * i, h, seed=i), packed(4, 32, h, i, seed=h)
    x = activations(m, h, seed=m + 1)
    gate_up = int8.int8_linear(x, int8.int8_blocks(gu.qweight, gu.scales, gu.zeros, 4, 32, 0))
    act = SiluAndMul()(gate_up)
    expected = int8.int8_linear(act, int8.int8_blocks(dn.qweight, dn.scales, dn.zeros, 4, 32, 0))
    got = int8.int8_gated_mlp(
        x,
        int8.int8_blocks(gu.qweight, gu.scales, gu.zeros, 4, 32, i),
        int8.int8_blocks(dn.qweight, dn.scales, dn.zeros, 4, 32, 0),
    )
    assert torch.equal(got, expected)


def test_int8_gated_mlp_refuses_a_down_weight_of_another_shape(int8):
    gu, dn = packed(4, 32, 128, 64, seed=1), packed(4, 32, 64, 96, seed=2)
    x = activations(8, 64, seed=3)
    with pytest.raises(RuntimeError, match="down must be int8_blocks'"):
        int8.int8_gated_mlp(
            x,
            int8.int8_blocks(gu.qweight, gu.scales, gu.zeros, 4, 32, 64),
            int8.int8_blocks(dn.qweight, dn.scales, dn.zeros, 4, 32, 0),
        )


@pytest.mark.parametrize("m", [1, 33, 300])
def test_int8_linear_rope_and_add_rms_norm_give_the_separate_ops_bits(int8, m):
    from llmctl.engine.kernels.cpu import layer_ops

    g = torch.Generator().manual_seed(m)
    x = activations(m, 96, seed=m + 2)
    qkv = packed(4, 32, 320, 96, seed=m)  # 5 heads of 64: 3 q, 1 k, 1 v
    blocks = int8.int8_blocks(qkv.qweight, qkv.scales, qkv.zeros, 4, 32, 0)
    cos, sin = torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g)
    positions = torch.randint(0, 1024, (m,), generator=g)
    expected = int8.int8_linear(x, blocks)
    plain = expected.clone()
    q, k = expected[:, :192].view(m, 3, 64), expected[:, 192:256].view(m, 1, 64)
    layer_ops.ops_for(x).rotary_embedding_(positions, q, k, cos, sin)
    got = int8.int8_linear_rope(x, blocks, positions, cos, sin, 256)
    assert torch.equal(got, expected) and torch.equal(got[:, 256:], plain[:, 256:])

    o = packed(4, 32, 96, 96, seed=m + 3)
    blocks = int8.int8_blocks(o.qweight, o.scales, o.zeros, 4, 32, 0)
    residual = torch.randn(m, 96, generator=g).bfloat16()
    weight = torch.randn(96, generator=g).bfloat16()
    y = int8.int8_linear(x, blocks)
    expected = layer_ops.ops_for(x).fused_add_rms_norm(y, residual, weight, 1e-5)
    got = int8.int8_linear_add_rms_norm(x, blocks, residual, weight, 1e-5)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(RuntimeError, match="position 1024 is outside the rotary table"):
        int8.int8_linear_rope(x, blocks, torch.full((m,), 1024), cos, sin, 64)


# The layers on the int8 path (Zen 4): a packed weight's prefill matmul and a quantized Llama MLP
# take the int8 kernels from INT8_LARGE_BATCH rows, and smaller batches keep the bfloat16 tiles.


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32)])
def test_a_packed_weight_at_prefill_runs_int8_linear(int8_path, bits, group):
    op = int8_path
    w = packed(bits, group, 96, 160, seed=bits)
    x = activations(kernels.INT8_LARGE_BATCH + 37, 160, seed=bits)
    y = w.matmul(x)
    blocks = op.int8_blocks(w.qweight, w.scales, w.zeros, bits, group, 0)
    assert torch.equal(y, op.int8_linear(x, blocks))
    small = x[: kernels.INT8_LARGE_BATCH - 1]  # below it: the bfloat16 tiles, the float numerics
    expected = small.double() @ w.dequantize(dtype=torch.bfloat16).double().T
    assert (w.matmul(small).double() - expected).abs().max() <= 2.0**-6 * expected.abs().max()


def test_a_quantized_llama_mlp_runs_the_int8_kernel_at_prefill(int8_path):
    mlp = quantized_mlp(96, 160)
    x = activations(kernels.INT8_LARGE_BATCH + 5, 96, seed=8)
    fused = gated_mlp.fused_gated_mlp(mlp.gate_up_proj, mlp.down_proj, x)
    assert fused is not None
    assert torch.equal(mlp(x), fused)
    assert torch.equal(fused, mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x))))  # the int8 layers'


def test_the_int8_kernels_start_at_their_own_batch_size(int8_path):
    assert kernels.prefill_rows("int8") == kernels.INT8_LARGE_BATCH < kernels.BF16_LARGE_BATCH
    assert kernels.prefill_rows("amx") == kernels.BF16_LARGE_BATCH
    mlp = quantized_mlp(64, 96)
    below = activations(kernels.INT8_LARGE_BATCH - 1, 64, seed=9)
    assert gated_mlp.fused_gated_mlp(mlp.gate_up_proj, mlp.down_proj, below) is None
    at = activations(kernels.INT8_LARGE_BATCH, 64, seed=9)
    assert gated_mlp.fused_gated_mlp(mlp.gate_up_proj, mlp.down_proj, at) is not None
