"""GEMMs on AMX tiles (amx_gemm.cpp): the quantized gated MLP (layers/gated_mlp.py) and the
quantized linear's prefill path (amx_linear).

vnni_blocks_bf16 must hold the float path's bfloat16 weights (dequantize_rows_bf16's) in AMX's
B layout, gate and up rows side by side. amx_gated_mlp must give the unfused layers' values: with
x and the gate/up weights small integers every gate/up sum is exact in float32, so the activation
silu(gate) * up, rounded where the layers round, is known to the bit (SiluAndMul's own kernel
computes the reference), and the output must be that activation times W_down in float64 up to
float32 sums and its rounding. Shapes: rows that leave a partial 32-row block (1, 33, 300), more
rows than one panel, H and I multiples of 32 but not of 64. A LlamaMLP with RTN int4 layers
must run the kernel at prefill and give the layers' output. amx_linear, and a packed weight's
matmul from BF16_LARGE_BATCH rows, must give x W^T in float64 up to float32 sums and rounding.
"""

from __future__ import annotations

import pytest
import torch
from quantized_layers import packed, quantized_mlp

from llmctl.engine.kernels.cpu import quantized_matmul as kernels
from llmctl.engine.layers import gated_mlp
from llmctl.engine.layers.activation import SiluAndMul
from llmctl.engine.layers.quantization.linear_method import set_quant_config
from llmctl.engine.layers.quantization.quant_config import QuantizationConfig
from llmctl.engine.platform import cpu_path


@pytest.fixture(scope="module")
def kernel():
    return kernels.build_kernel()


@pytest.fixture(scope="module")
def amx(kernel):
    if cpu_path().name != "amx" or not kernel.amx_built():
        pytest.skip(f"{cpu_path().name} CPU: the gated MLP kernel runs on AMX tiles only")
    return kernel


def vnni_layout(w: torch.Tensor, gate_up_half: int = 0) -> torch.Tensor:
    """W [N, K] as [N / 32, K / 2, 32, 2]: block b's column j holds row j of the block."""
    n, k = w.shape
    if gate_up_half:
        half = gate_up_half
        w = torch.stack([w[:half].view(half // 16, 16, k), w[half:].view(half // 16, 16, k)], 1)
        w = w.reshape(n, k)
    return w.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize(
    "bits, group, n, k, gate_up_half",
    [(4, 32, 64, 96, 0), (4, 32, 96, 160, 48), (8, 32, 64, 96, 32), (8, 16, 32, 416, 0)],
)
def test_vnni_blocks_hold_the_float_paths_weights(kernel, bits, group, n, k, gate_up_half):
    w = packed(bits, group, n, k, seed=n + k)
    blocks = kernel.vnni_blocks_bf16(w.qweight, w.scales, w.zeros, bits, group, gate_up_half)
    expected = kernel.dequantize_rows_bf16(w.qweight, w.scales, w.zeros, bits, group, 0, n)
    assert blocks.dtype == torch.bfloat16 and blocks.shape == (n // 32, k // 2, 32, 2)
    assert torch.equal(blocks, vnni_layout(expected, gate_up_half))


def test_vnni_blocks_refuse_shapes_they_cannot_lay_out(kernel):
    w = packed(4, 32, 48, 96, seed=1)
    with pytest.raises(RuntimeError, match="rows must be a multiple of 32"):
        kernel.vnni_blocks_bf16(w.qweight, w.scales, w.zeros, 4, 32, 0)
    with pytest.raises(RuntimeError, match="gate_up_half must be half"):
        kernel.vnni_blocks_bf16(w.qweight, w.scales, w.zeros, 4, 32, 16)


def small_integers(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(torch.bfloat16)


def mlp_case(m: int, h: int, i: int, seed: int = 0):
    x = small_integers((m, h), seed)
    gate_up = small_integers((2 * i, h), seed + 1)
    down = (torch.randn(h, i, generator=torch.Generator().manual_seed(seed + 2)) / 8).bfloat16()
    return x, gate_up, down


def assert_mlp_output(y, x, gate_up, down):
    """y = act W_down^T in float64 up to float32 sums and y's rounding, act exact."""
    h = (x.double() @ gate_up.double().T).to(torch.bfloat16)  # exact sums, rounded once
    act = SiluAndMul()(h).double()
    expected = act @ down.double().T
    magnitude = act.abs() @ down.double().abs().T
    bound = 2.0**-8 * expected.abs() + 1e-5 * magnitude
    assert y.dtype == torch.bfloat16 and y.shape == expected.shape
    worst = ((y.double() - expected).abs() - bound).max().item()
    assert worst <= 0, f"an output is {worst:.3g} past its bound"


@pytest.mark.parametrize("m, h, i", [(1, 64, 64), (33, 96, 64), (300, 64, 160), (600, 32, 96)])
def test_gated_mlp_gives_the_layers_values(amx, m, h, i):
    x, gate_up, down = mlp_case(m, h, i)
    y = amx.amx_gated_mlp(x, vnni_layout(gate_up, i), vnni_layout(down))
    assert_mlp_output(y, x, gate_up, down)


def test_a_partial_block_of_rows_gets_the_rows_of_a_whole_one(amx):
    x, gate_up, down = mlp_case(64, 96, 64, seed=5)
    gu, dn = vnni_layout(gate_up, 64), vnni_layout(down)
    whole = amx.amx_gated_mlp(x, gu, dn)
    for m in (1, 31, 33, 63):
        assert torch.equal(amx.amx_gated_mlp(x[:m].contiguous(), gu, dn), whole[:m])


def test_torchs_brgemm_runs_after_the_kernel(amx):
    """The kernel configures AMX tiles its own way: torch's brgemm (the tiled matmul of a
    quantized layer at 64 rows) must still give its result afterwards."""
    w = packed(4, 32, 96, 160, seed=3)
    x = torch.randn(64, 160, generator=torch.Generator().manual_seed(4)).bfloat16()
    before = w.matmul(x)
    x2, gate_up, down = mlp_case(40, 64, 64)
    amx.amx_gated_mlp(x2, vnni_layout(gate_up, 64), vnni_layout(down))
    assert torch.equal(w.matmul(x), before)


def test_gated_mlp_refuses_mismatched_weights(amx):
    x, gate_up, down = mlp_case(8, 64, 64)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        amx.amx_gated_mlp(x, vnni_layout(gate_up[:, :32].contiguous(), 64), vnni_layout(down))
    with pytest.raises(RuntimeError, match="down's I"):
        amx.amx_gated_mlp(x, vnni_layout(gate_up, 64), vnni_layout(down[:, :32].contiguous()))
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        amx.amx_gated_mlp(x.float(), vnni_layout(gate_up, 64), vnni_layout(down))


def test_a_quantized_llama_mlp_runs_the_kernel_at_prefill(amx):
    mlp = quantized_mlp(96, 160)
    rows = kernels.BF16_LARGE_BATCH + 5
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    fused = gated_mlp.fused_gated_mlp(mlp.gate_up_proj, mlp.down_proj, x)
    assert fused is not None
    assert torch.equal(mlp(x), fused)
    # the layers' own output (oneDNN's GEMMs, which add in another order): the same values up
    # to the few sums that round one ulp apart
    unfused = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x))).double()
    error = (fused.double() - unfused).norm() / unfused.norm()
    assert error < 2.0**-8, f"relative error {error:.3g}"
    assert (fused.double() - unfused).abs().max() <= 2.0**-5 * unfused.abs().max()


def first_prefill_row() -> int:
    """Rows from which this CPU's prefill GEMM runs (quantized_matmul.prefill_rows)."""
    prefill = gated_mlp.prefill_op()
    return kernels.BF16_LARGE_BATCH if prefill is None else kernels.prefill_rows(prefill[1])


def test_decode_batches_and_float32_keep_the_layers(kernel):
    mlp = quantized_mlp(64, 64)
    small = torch.randn(first_prefill_row() - 1, 64).bfloat16()
    assert gated_mlp.fused_gated_mlp(mlp.gate_up_proj, mlp.down_proj, small) is None
    wide = torch.randn(kernels.BF16_LARGE_BATCH, 64)
    assert gated_mlp.fused_gated_mlp(mlp.gate_up_proj, mlp.down_proj, wide) is None


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x W^T in float64 on W's bfloat16 values, up to float32 sums and y's own rounding."""
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    expected = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    bound = 2.0**-8 * expected.abs() + 1e-5 * magnitude
    worst = ((y.double() - expected).abs() - bound).max().item()
    assert worst <= 0, f"an output is {worst:.3g} past its bound"


@pytest.mark.parametrize("m, n, k", [(1, 32, 64), (33, 96, 160), (300, 64, 96), (600, 160, 32)])
def test_amx_linear_gives_x_times_w(amx, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    assert_bf16_product(amx.amx_linear(x, vnni_layout(w)), x, w)


def test_amx_linear_refuses_a_weight_of_another_k(amx):
    x = torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="w must be vnni_blocks_bf16's"):
        amx.amx_linear(x, vnni_layout(torch.randn(32, 96).bfloat16()))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32)])
def test_a_packed_weight_at_prefill_runs_amx_linear(amx, bits, group):
    w = packed(bits, group, 96, 160, seed=bits)
    assert kernels.prefill_gemm(amx) == "amx"
    x = torch.randn(kernels.BF16_LARGE_BATCH + 37, 160).bfloat16()
    y = w.matmul(x)
    assert torch.equal(
        y, amx.amx_linear(x, amx.vnni_blocks_bf16(w.qweight, w.scales, w.zeros, bits, group, 0))
    )
    assert_bf16_product(y, x, w.dequantize(dtype=torch.bfloat16))


# QKV with RoPE and O with the residual add and RMSNorm, each in the GEMM's pass over a panel of
# rows (amx_linear_rope, amx_linear_add_rms_norm; layers/linear_epilogue.py): the separate
# ops' bits, from the same GEMM (amx_linear) and the same row code (layer_ops' RoPE and norm).


def epilogue_case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / 16).bfloat16()
    return x, w, g


@pytest.mark.parametrize("m", [1, 33, 300, 600])
def test_linear_rope_rotates_the_query_and_key_columns_only(amx, m):
    from llmctl.engine.kernels.cpu import layer_ops

    x, w, g = epilogue_case(m, 320, 96, seed=m)  # 5 heads of 64: 3 q, 1 k, 1 v
    cos, sin = torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g)
    positions = torch.randint(0, 1024, (m,), generator=g)
    expected = amx.amx_linear(x, vnni_layout(w))
    plain = expected.clone()
    q, k = expected[:, :192].view(m, 3, 64), expected[:, 192:256].view(m, 1, 64)
    layer_ops.ops_for(x).rotary_embedding_(positions, q, k, cos, sin)
    got = amx.amx_linear_rope(x, vnni_layout(w), positions, cos, sin, 256)
    assert torch.equal(got, expected)
    assert torch.equal(got[:, 256:], plain[:, 256:]) and not torch.equal(
        got[:, :256], plain[:, :256]
    )


@pytest.mark.parametrize("m", [1, 33, 300, 600])
def test_linear_add_rms_norm_gives_the_norm_of_the_sum(amx, m):
    from llmctl.engine.kernels.cpu import layer_ops

    x, w, g = epilogue_case(m, 96, 160, seed=m + 1)
    residual = torch.randn(m, 96, generator=g).bfloat16()
    weight = torch.randn(96, generator=g).bfloat16()
    y = amx.amx_linear(x, vnni_layout(w))
    expected = layer_ops.ops_for(x).fused_add_rms_norm(y, residual, weight, 1e-5)
    got = amx.amx_linear_add_rms_norm(x, vnni_layout(w), residual, weight, 1e-5)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(got[1], (y.float() + residual.float()).bfloat16())


def test_the_epilogue_ops_refuse_what_they_cannot_take(amx):
    x, w, g = epilogue_case(8, 128, 64, seed=2)
    cos = sin = torch.zeros(16, 64)
    with pytest.raises(RuntimeError, match="whole heads of 64"):
        amx.amx_linear_rope(x, vnni_layout(w), torch.zeros(8, dtype=torch.long), cos, sin, 96)
    with pytest.raises(RuntimeError, match="position 16 is outside the rotary table"):
        amx.amx_linear_rope(x, vnni_layout(w), torch.full((8,), 16), cos, sin, 64)
    with pytest.raises(RuntimeError, match="one int64 position per row"):
        amx.amx_linear_rope(x, vnni_layout(w), torch.zeros(7, dtype=torch.long), cos, sin, 64)
    with pytest.raises(RuntimeError, match="residual must be a contiguous bfloat16"):
        amx.amx_linear_add_rms_norm(
            x, vnni_layout(w), torch.zeros(8, 96).bfloat16(), torch.ones(128).bfloat16(), 1e-5
        )
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16"):
        amx.amx_linear_add_rms_norm(
            x, vnni_layout(w), torch.zeros(8, 128).bfloat16(), torch.ones(128), 1e-5
        )


def quantized_attention_layers(hidden: int, heads: int, kv_heads: int, head_dim: int):
    from llmctl.engine.layers.layernorm import RMSNorm
    from llmctl.engine.layers.linear import QKVParallelLinear, RowParallelLinear
    from llmctl.engine.layers.rotary_embedding import get_rope

    with set_quant_config(QuantizationConfig(method="int4", group_size=32)):
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
        o = RowParallelLinear(heads * head_dim, hidden, bias=False)
    g = torch.Generator().manual_seed(9)
    for shard, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        qkv.weight_loader(qkv.weight, torch.randn(rows * head_dim, hidden, generator=g), shard)
    o.weight_loader(o.weight, torch.randn(hidden, heads * head_dim, generator=g) / 8)
    rope = get_rope(head_dim, 2048, {"rope_type": "default", "rope_theta": 10000.0})
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.randn(hidden, generator=g) / 4 + 1).bfloat16()
    return qkv, o, rope, norm


def test_quantized_qkv_and_o_layers_take_the_epilogues_at_prefill(amx):
    from llmctl.engine.layers import linear_epilogue

    qkv, o, rope, norm = quantized_attention_layers(128, 4, 2, 32)
    rows = kernels.BF16_LARGE_BATCH + 5
    g = torch.Generator().manual_seed(10)
    x = torch.randn(rows, 128, generator=g).bfloat16()
    positions = torch.randint(0, 2048, (rows,), generator=g)
    fused = linear_epilogue.linear_rope(qkv, rope, positions, x, 128 + 64)
    assert fused is not None
    expected = qkv(x)
    q, k = expected[:, :128].view(rows, 4, 32), expected[:, 128:192].view(rows, 2, 32)
    rope(positions, q, k)
    assert torch.equal(fused, expected)

    attn_out = torch.randn(rows, 128, generator=g).bfloat16()
    residual = torch.randn(rows, 128, generator=g).bfloat16()
    fused = linear_epilogue.linear_add_rms_norm(o, norm, attn_out, residual)
    assert fused is not None
    expected = norm(o(attn_out), residual)
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


def test_decode_batches_float32_and_other_norms_keep_the_layers(kernel):
    from llmctl.engine.layers import linear_epilogue
    from llmctl.engine.models.gemma3 import GemmaRMSNorm

    qkv, o, rope, norm = quantized_attention_layers(128, 4, 2, 32)
    small = torch.randn(first_prefill_row() - 1, 128).bfloat16()
    positions = torch.zeros(small.shape[0], dtype=torch.long)
    assert linear_epilogue.linear_rope(qkv, rope, positions, small, 192) is None
    assert linear_epilogue.linear_add_rms_norm(o, norm, small, small) is None
    wide = torch.randn(kernels.BF16_LARGE_BATCH, 128)
    assert linear_epilogue.linear_add_rms_norm(o, norm, wide, wide) is None
    big = wide.bfloat16()
    assert linear_epilogue.linear_add_rms_norm(o, GemmaRMSNorm(128, 1e-5), big, big) is None
