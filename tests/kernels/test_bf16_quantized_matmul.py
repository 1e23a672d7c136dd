"""Quantized matmuls with bfloat16 activations on the CPU (quantized_matmul_bf16.cpp).

The batched path expands W into bfloat16 tiles for oneDNN's brgemm (AMX, or AVX512-BF16): its
tiles must hold exactly the float path's weights (W dequantized to float32, rounded to bfloat16),
and its output must be x W^T in float64 on those weights up to float32 sums and the output's
rounding, on odd shapes (N not a multiple of the 16-row tiles, K not a multiple of 256, int8
groups of 16 whose K leaves half a 32-weight chunk: the one-pair-at-a-time expansion). The
decode kernels take bfloat16 rows and must give their float32 result, rounded.
"""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.kernels.cpu import quantized_matmul as kernels
from llmctl.engine.layers.quantization.rtn import quantize_rtn
from llmctl.engine.platform import cpu_path

pytestmark = pytest.mark.skipif(
    not cpu_path().bf16_tiles,
    reason=f"{cpu_path().name} CPU: bfloat16 tiles run on CPUs with AMX or AVX512-BF16",
)

# (bits, group_size, N, K)
SHAPES = [
    (4, 32, 13, 96),
    (4, 32, 203, 160),
    (4, 128, 37, 384),
    (8, 32, 203, 160),
    (8, 16, 29, 400),
]
ROWS = [5, 64, kernels.BF16_LARGE_BATCH - 1, 300, kernels.LARGE_BATCH + 3]


@pytest.fixture(scope="module")
def kernel():
    return kernels.build_kernel()


def packed_weight(bits: int, group_size: int, n: int, k: int, scale_dtype: torch.dtype):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q, scales, zeros = quantize_rtn(w, bits, group_size)
    zeros = None if zeros is None else zeros.to(scale_dtype)
    return kernels.pack_groups(q, scales.to(scale_dtype), zeros, bits, group_size)


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, w_bf16: torch.Tensor) -> None:
    """y = x W^T in float64 on W's bfloat16 values, up to float32 sums and y's own rounding."""
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w_bf16.shape[0])
    expected = x.double() @ w_bf16.double().T
    magnitude = x.double().abs() @ w_bf16.double().abs().T
    bound = 2.0**-8 * expected.abs() + 1e-5 * magnitude  # bfloat16 rounding + float32 sums
    worst = ((y.double() - expected).abs() - bound).max().item()
    assert worst <= 0, f"an output is {worst:.3g} past its bound"


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bits, group_size, n, k", SHAPES)
def test_tiles_hold_the_float_paths_bfloat16_weights(kernel, bits, group_size, n, k, scale_dtype):
    packed = packed_weight(bits, group_size, n, k, scale_dtype)
    expanded = packed.dequantize(dtype=torch.bfloat16)
    assert torch.equal(expanded, packed.dequantize().to(torch.bfloat16))
    assert torch.equal(packed.dequantize(7, n, torch.bfloat16), expanded[7:])


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bits, group_size, n, k", SHAPES)
def test_bf16_matmul_matches_float64(kernel, bits, group_size, n, k, m):
    packed = packed_weight(bits, group_size, n, k, torch.float16)
    w_bf16 = packed.dequantize().to(torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    assert_bf16_product(packed.matmul(x), x, w_bf16)
    if m < kernels.LARGE_BATCH:  # the tiles themselves, at both ends of the tile sizes
        for tile_rows in (16, 64):
            y = kernel.tiled_group_mm(
                x, packed.qweight, packed.scales, packed.zeros, bits, group_size, tile_rows
            )
            assert_bf16_product(y, x, w_bf16)


@pytest.mark.parametrize("prepack", ["1", "0"])
def test_a_large_batch_with_and_without_onednn_packing(kernel, monkeypatch, prepack):
    # From BF16_LARGE_BATCH rows the expanded W goes to oneDNN packed (_linear_pointwise), or
    # with LLMCTL_CPU_PREPACK=0 to plain F.linear: the same products either way
    monkeypatch.setenv("LLMCTL_CPU_PREPACK", prepack)
    packed = packed_weight(4, 32, 203, 160, torch.float16)
    w_bf16 = packed.dequantize().to(torch.bfloat16)
    x = torch.randn(300, 160, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert_bf16_product(packed.matmul(x), x, w_bf16)


@pytest.mark.parametrize("m", [1, 3, kernels.BF16_SMALL_BATCH])
@pytest.mark.parametrize("bits, group_size, n, k", SHAPES)
def test_decode_kernels_on_bf16_rows_match_their_float32_rows(kernel, bits, group_size, n, k, m):
    packed = packed_weight(bits, group_size, n, k, torch.float16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = packed.matmul(x)  # up to BF16_SMALL_BATCH rows: the decode kernel, fed bfloat16
    assert y.dtype == torch.bfloat16
    widened = packed.matmul(x.float()).to(torch.bfloat16)
    if bits == 4 and cpu_path().name == "avx512_bf16":
        # int4 by bfloat16 dot products (quantized_matmul_cpu.cpp, LLMCTL_Q_BF16DOT): the same
        # exact products summed in another order, so at most one bfloat16 step apart
        assert ((y.float() - widened.float()).abs() <= 2**-7 * widened.float().abs()).all()
    else:  # bfloat16 rows widened to float32 in the kernel: the float32 rows' bits, rounded
        assert torch.equal(y, widened)


def test_bad_tile_rows_are_refused(kernel):
    packed = packed_weight(4, 32, 13, 96, torch.float16)
    x = torch.zeros(8, 96, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.tiled_group_mm(x, packed.qweight, packed.scales, packed.zeros, 4, 32, 24)


def _busiest_thread_rows(n: int, rows: int, threads: int) -> int:
    """Rows of W the busiest thread expands: at::parallel_for gives each thread one run of
    ceil(tiles / threads) tiles."""
    tiles = -(-n // rows)
    per = -(-tiles // threads)
    return min(n, per * rows)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [16, 100, 576, 960, 1536, 3072, 49152])
def test_tile_rows_split_the_weight_evenly_between_threads(n, threads):
    rows = kernels.bf16_tile_rows(n, threads)
    assert rows % 16 == 0 and 16 <= rows <= 128
    # no thread expands more than a fair share plus one tile
    assert _busiest_thread_rows(n, rows, threads) <= -(-n // threads) + rows


def test_smollm2s_576_row_weights_split_exactly_in_two():
    # 5 tiles of 128 split 3 to 2 left one thread idle a third of O and down projections
    assert _busiest_thread_rows(576, kernels.bf16_tile_rows(576, 2), 2) == 288
