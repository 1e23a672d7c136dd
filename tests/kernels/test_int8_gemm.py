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

The AVX2 flavour (int4_group_mm_int8_act: float32 x on VPMADDUBSW, 4-bit weights, the AVX2 CPU
path's prefill batches) has the same numerics from float32 x into float32 y; it is
built wherever the CPU has AVX2 and FMA, so every machine kind runs its tests.
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


def activations(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows with what quantization meets: a block of zeros, an outlier, tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0
    if m > 2:
        x[1, 5] = 300.0
        x[2] *= 1e-3
    return x.to(dtype)


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


# The AVX2 flavour: float32 x, 4-bit weights, float32 y.


@pytest.fixture(scope="module")
def int8_act():
    op = kernels.build_kernel()
    if not op.int8_f32_built():
        pytest.skip("this build has no AVX2 int8 GEMM (the CPU lacks AVX2 and FMA)")
    return op


def assert_int8_product_f32(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x^ W^T in float64, up to float32 sums (y float32)."""
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    xq = quantized_activations(x)
    expected = xq @ w.double().T
    bound = 1e-5 * (xq.abs() @ w.double().abs().T) + 1e-6 * expected.abs()
    worst = ((y.double() - expected).abs() - bound).max().item()
    assert worst <= 0, f"an output is {worst:.3g} past its bound"


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "group, m, n, k",
    [
        (32, 1, 32, 32),
        (32, 37, 64, 96),
        (64, 255, 96, 576),  # below 256 rows: each thread lays out its own weight panels
        (128, 300, 32, 256),  # from 256: W laid out once, the threads split the rows
        (32, 27, 960, 1536),
    ],
)
def test_int8_act_mm_gives_the_quantized_activations_times_w(int8_act, group, m, n, k, scale_dtype):
    w = packed(4, group, n, k, seed=m + n + k)
    s, z = w.scales.to(scale_dtype), w.zeros.to(scale_dtype)
    x = activations(m, k, seed=m, dtype=torch.float32)
    y = int8_act.int4_group_mm_int8_act(x, w.qweight, s, z, group)
    assert_int8_product_f32(y, x, w.dequantize())


def test_int8_act_mm_rows_do_not_depend_on_the_batch(int8_act):
    """A row's sums are the same whichever way the rows are split (threads, micro tiles, the
    laid-out W from 256 rows): the engine's tokens do not depend on the batch."""
    w = packed(4, 32, 64, 576, seed=11)
    x = activations(300, 576, seed=12, dtype=torch.float32)

    def mm(rows: torch.Tensor) -> torch.Tensor:
        return int8_act.int4_group_mm_int8_act(rows, w.qweight, w.scales, w.zeros, 32)

    full = mm(x)
    for rows in (1, 5, 200):
        assert torch.equal(mm(x[:rows].contiguous()), full[:rows])


def test_int8_act_mm_has_the_vnni_kernels_sums(int8, int8_act):
    """The two flavours quantize x alike and add the same float32 terms in the same order:
    on bfloat16 values, the AVX2 flavour's float32 output rounds to the VNNI one's bits."""
    w = packed(4, 32, 96, 576, seed=13)
    x = activations(70, 576, seed=14)
    vnni = int8.int8_linear(x, int8.int8_blocks(w.qweight, w.scales, w.zeros, 4, 32, 0))
    avx2 = int8_act.int4_group_mm_int8_act(x.float(), w.qweight, w.scales, w.zeros, 32)
    assert torch.equal(avx2.bfloat16(), vnni)


def test_int8_act_mm_refuses_what_it_cannot_multiply(int8_act):
    w = packed(4, 32, 48, 64, seed=1)
    x = torch.randn(30, 64)
    with pytest.raises(RuntimeError, match="N and K must be multiples of 32"):
        int8_act.int4_group_mm_int8_act(x, w.qweight, w.scales, w.zeros, 32)
    w = packed(4, 32, 64, 64, seed=1)
    with pytest.raises(RuntimeError, match="x has 96 features, the weight 64"):
        int8_act.int4_group_mm_int8_act(torch.randn(30, 96), w.qweight, w.scales, w.zeros, 32)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        int8_act.int4_group_mm_int8_act(x.bfloat16(), w.qweight, w.scales, w.zeros, 32)
    w8 = packed(8, 32, 64, 64, seed=1)  # 8-bit weights: their byte products would overflow
    with pytest.raises(RuntimeError, match="qp must be a contiguous uint8"):
        int8_act.int4_group_mm_int8_act(x, w8.qweight, w8.scales, w8.scales, 32)


def test_avx2_path_batches_take_int8_activations_on_4bit_weights_only(int8_act, monkeypatch):
    """On the AVX2 path a packed weight made for int8 activations (a dtype "auto" model's) runs
    its float32 batches of INT8_FLOAT32_BATCH rows or more (64 sequences decoding, a prompt of 64
    tokens) through int4_group_mm_int8_act; fewer rows (smaller decode batches, short prompts),
    8-bit weights and weights made without it keep float32 numerics."""
    monkeypatch.setattr(kernels, "float32_int8", lambda op: True)  # the AVX2 path's decision
    with kernels.int8_activations(True):  # as the loader makes a dtype "auto" model's weights
        w4, w8 = packed(4, 32, 64, 160, seed=4), packed(8, 32, 64, 160, seed=8)
    plain = packed(4, 32, 64, 160, seed=4)  # made outside: dtype="float32" asked for by name
    assert (w4.int8_act, w8.int8_act, plain.int8_act) == (True, True, False)
    assert kernels.INT8_FLOAT32_BATCH == 64
    x = activations(kernels.INT8_FLOAT32_BATCH, 160, seed=15, dtype=torch.float32)
    assert torch.equal(
        w4.matmul(x), int8_act.int4_group_mm_int8_act(x, w4.qweight, w4.scales, w4.zeros, 32)
    )
    assert kernels.PackedLinearWeight.cat([w4, w4]).int8_act
    for w, rows in ((w4, x[:-1]), (w4, x[: kernels.SMALL_BATCH]), (w8, x), (plain, x)):
        expected = rows.double() @ w.dequantize().double().T
        assert (w.matmul(rows).double() - expected).abs().max() <= 1e-5 * expected.abs().max()
