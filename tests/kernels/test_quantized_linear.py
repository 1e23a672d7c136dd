"""Quantized linear weights: GGUF blocks, round-to-nearest quantizers and the packed matmul.

Each packed matmul is checked against x @ W^T in float64 on W dequantized by the reference
(gguf.quants.dequantize for GGUF types), for decode (M=1), a few rows (M=5), a batch (M=64,
the tiled path) and a long prefill (M=LARGE_BATCH, W expanded in chunks), on odd shapes: N not
a multiple of 8, K not a multiple of 256 where the format allows it. The C++ kernel is built
for real (build_kernel raises if it cannot be), so these tests fail on a machine where the
engine would silently fall back to plain torch.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.kernels.cpu import quantized_matmul as kernels
from llmctl.engine.kernels.triton import triton_group_mm, triton_ops
from llmctl.engine.layers.quantization import gguf_quants
from llmctl.engine.layers.quantization.rtn import quantize_rtn

T = GGMLQuantizationType
# (type, N, K): K a multiple of 32 but not of 256 for the 32-element blocks
SHAPES = [
    (t, n, k)
    for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K)
    for n, k in (
        [(13, 96), (203, 160)] if GGML_QUANT_SIZES[t][0] == 32 else [(13, 256), (203, 512)]
    )
]
ROWS = [1, 5, 64, kernels.LARGE_BATCH]
DTYPES = [torch.float32, torch.bfloat16]


def gguf_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """The raw bytes of an [n, k] tensor: quantized by gguf where it can, else random valid
    blocks (random bits, finite float16 super-block scales)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, type_size), dtype=np.uint8)

    def f16(low: float, high: float) -> np.ndarray:
        values = rng.uniform(low, high, (n, k // block)).astype(np.float16)
        return values.view(np.uint8).reshape(n, k // block, 2)

    if qtype == T.Q4_K:  # d, dmin first
        raw[..., 0:2], raw[..., 2:4] = f16(-0.05, 0.05), f16(0, 0.05)
    else:  # Q6_K: d last
        raw[..., 208:210] = f16(-0.05, 0.05)
    return raw.reshape(n, -1)


@pytest.fixture(scope="module")
def kernel():
    return kernels.build_kernel()


def assert_matmul_close(
    packed, w_ref: torch.Tensor, m: int, dtype: torch.dtype, matmul=None, device="cpu"
) -> torch.Tensor:
    """`matmul(packed, x)` (default: packed.matmul) with x on `device`, against float64 on the
    reference W; returns the output as computed (on `device`)."""
    x = torch.randn(m, w_ref.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype)
    expected = x.double() @ w_ref.double().T
    result = (matmul or type(packed).matmul)(packed, x.to(device))
    out = result.cpu()
    assert out.dtype == dtype and out.shape == (m, w_ref.shape[0])
    # float32 accumulation over K terms; bf16 adds the output's own rounding (2^-8 relative)
    magnitude = (x.double().abs() @ w_ref.double().abs().T).max().item()
    tolerance = 1e-5 * magnitude if dtype == torch.float32 else 1e-2 * magnitude
    err = (out.double() - expected).abs().max().item()
    assert err <= tolerance, f"max abs error {err} > {tolerance}"
    return result


@pytest.mark.parametrize("qtype, n, k", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_blocks_match_gguf_dequantize(qtype, n, k):
    raw = gguf_blocks(qtype, n, k)
    groups = gguf_quants.unpack_blocks(raw, qtype, n, k)
    assert np.array_equal(gguf_quants.dequantize(groups), quants.dequantize(raw, qtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("qtype, n, k", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_packed_matmul_matches_reference(kernel, qtype, n, k, m, dtype):
    raw = gguf_blocks(qtype, n, k)
    packed = gguf_quants.pack_gguf(raw, qtype, n, k)
    reference = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(packed.dequantize(), reference)
    bits, group_size = gguf_quants.packed_format(qtype)
    assert (packed.bits, packed.group_size) == (bits, group_size)
    scale_bytes = gguf_quants.scale_bytes(qtype.name)  # the file's fp16 scales kept as float16
    assert packed.scales.element_size() == scale_bytes
    assert packed.nbytes == gguf_quants.packed_nbytes(n, k, bits, group_size, scale_bytes)
    assert_matmul_close(packed, reference, m, dtype)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 128), (8, 32), (8, 16)])
def test_rtn_packed_matmul_and_error_bound(kernel, bits, group_size, m):
    n, k = 203, 384
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    w[0, :group_size] = 0.25  # a constant group: reproduced exactly
    q, scales, zeros = quantize_rtn(w, bits, group_size)
    packed = kernels.pack_groups(q, scales, zeros, bits, group_size)
    dequantized = packed.dequantize()
    bound = scales.repeat_interleave(group_size, dim=1) / 2 * (1 + 1e-5)
    assert ((w - dequantized).abs() <= bound).all()
    assert torch.equal(dequantized[0, :group_size], w[0, :group_size])
    assert packed.nbytes == gguf_quants.packed_nbytes(n, k, bits, group_size)
    assert_matmul_close(packed, dequantized, m, torch.float32)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda v: v.name)
def test_long_prefill_in_several_chunks(kernel, monkeypatch, qtype):
    # 203 rows of W expanded 50 at a time: four whole chunks and a remainder, each GEMM written
    # into its own columns of y
    n, k = 203, 512
    monkeypatch.setattr(kernels, "_CHUNK_BYTES", 50 * 4 * k)
    raw = gguf_blocks(qtype, n, k, seed=3)
    packed = gguf_quants.pack_gguf(raw, qtype, n, k)
    reference = torch.from_numpy(quants.dequantize(raw, qtype))
    assert_matmul_close(packed, reference, kernels.LARGE_BATCH + 3, torch.float32)


@pytest.mark.parametrize("m", ROWS)
def test_torch_fallback_without_compiler(monkeypatch, m):
    raw = gguf_blocks(T.Q4_K, 13, 256)
    packed = gguf_quants.pack_gguf(raw, T.Q4_K, 13, 256)
    monkeypatch.setattr(kernels, "_kernel", lambda: None)
    reference = torch.from_numpy(quants.dequantize(raw, T.Q4_K))
    assert torch.allclose(packed.dequantize(), reference, atol=1e-6)
    assert_matmul_close(packed, reference, m, torch.float32)
    q8 = gguf_quants.pack_gguf(gguf_blocks(T.Q6_K, 13, 256), T.Q6_K, 13, 256)
    reference8 = torch.from_numpy(quants.dequantize(gguf_blocks(T.Q6_K, 13, 256), T.Q6_K))
    assert_matmul_close(q8, reference8, m, torch.float32)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda v: v.name)
def test_embedding_rows(kernel, qtype):
    raw = gguf_blocks(qtype, 40, 256)
    packed = gguf_quants.pack_gguf(raw, qtype, 40, 256)
    reference = torch.from_numpy(quants.dequantize(raw, qtype))
    ids = torch.tensor([[3, 0, 39], [3, 17, 5]])
    assert torch.equal(packed.embedding(ids), reference[ids])
    # One id (a decode step's token) takes the kernel's one-row call; any shape of it.
    assert kernels._kernel() is not None
    for one in (torch.tensor([39]), torch.tensor(17), torch.tensor([[0]])):
        assert torch.equal(packed.embedding(one), reference[one])
    for bad in (40, -1):
        with pytest.raises(IndexError, match="outside the 40 embedding rows"):
            packed.embedding(torch.tensor([bad]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K])
def test_thread_split_and_batch_change_no_bits(kernel, qtype, dtype):
    # 1002 rows: blocks of 4 weight rows (decode) with a remainder, split anew by each thread
    # count; bfloat16 x (up to BF16_SMALL_BATCH rows) on int4 weights takes the bfloat16 dot
    # products on CPUs with AVX512-BF16 and the 256-bit loops
    k = 512
    raw = gguf_blocks(qtype, 1002, k)
    packed = gguf_quants.pack_gguf(raw, qtype, 1002, k)
    x = torch.randn(3, k).to(dtype)
    out = packed.matmul(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed.matmul(x), out)
    finally:
        torch.set_num_threads(threads)
    # A sequence decoded alone (M=1, the row-blocked path) gets its row of the batch's bits.
    for m in range(3):
        assert torch.equal(packed.matmul(x[m : m + 1].contiguous()), out[m : m + 1])


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "n, k, group_size", [(203, 96, 32), (37, 384, 128), (6, 160, 32), (11, 384, 96)]
)
def test_int4_decode_on_bfloat16_activations(kernel, n, k, group_size, scale_dtype, m):
    """bfloat16 x at decode (M <= 4) against float64 on x's own values: every nibble value and
    both nibbles of a byte, odd N (blocks of 4 weight rows and a remainder), groups of one and of
    several 32-weight chunks, an odd number of chunks (the AVX512-BF16 loops take two a step, the
    last alone) and groups of 3 chunks (a step's two chunks in two groups). The only errors
    allowed: float32 sums and the output's rounding to bfloat16 (VDPBF16PS's products of a
    bfloat16 and a value 16 + q are exact)."""
    gen = torch.Generator().manual_seed(n + m)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q[0, :16] = torch.arange(16, dtype=torch.uint8)  # each value in a low nibble ...
    q[0, 16:32] = torch.arange(15, -1, -1, dtype=torch.uint8)  # ... and in a high one
    scales = (torch.rand(n, k // group_size, generator=gen) / 8).to(scale_dtype)
    zeros = (-torch.rand(n, k // group_size, generator=gen)).to(scale_dtype)
    packed = kernels.pack_groups(q, scales, zeros, 4, group_size)
    w = packed.dequantize().double()
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    out = kernel.int4_group_mm(x, packed.qweight, packed.scales, packed.zeros, group_size)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    expected = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    err = (out.double() - expected).abs()
    assert (err <= 2**-8 * expected.abs() + 1e-5 * magnitude).all(), err.max().item()


def test_unsupported_gguf_type_names_the_supported_ones():
    with pytest.raises(ModelLoadError) as e:
        gguf_quants.unpack_blocks(np.zeros(176, np.uint8), T.Q5_K, 1, 256, "blk.0.ffn_up.weight")
    message = str(e.value)
    assert "blk.0.ffn_up.weight" in message and "Q5_K" in message
    for name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        assert name in message
    assert "--quantization" in e.value.hint


def test_truncated_tensor_is_a_load_error():
    raw = gguf_blocks(T.Q8_0, 4, 64)
    with pytest.raises(ModelLoadError, match="expected"):
        gguf_quants.unpack_blocks(raw.reshape(-1)[:-1], T.Q8_0, 4, 64)


def test_pack_groups_rejects_groups_the_kernel_cannot_read():
    q = torch.zeros(4, 48, dtype=torch.uint8)
    s = torch.ones(4, 3)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.pack_groups(q, s, s, 4, 16)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        kernels.pack_groups(q, torch.ones(4, 1), None, 8, 32)


# A build for another instruction set takes the kernel's other code path (scalar; native is the
# AVX2 path on AVX2 and AVX-512 machines alike); a separate compile, then cached.
VARIANTS = [pytest.param("x86-64", id="scalar")]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 build variants")
@pytest.mark.parametrize("march", VARIANTS)
def test_other_instruction_sets(monkeypatch, march):
    op = kernels.build_kernel(march)
    monkeypatch.setattr(kernels, "_kernel", lambda: op)
    for qtype, n, k in [(T.Q4_0, 13, 96), (T.Q6_K, 13, 256), (T.Q8_0, 9, 64)]:
        raw = gguf_blocks(qtype, n, k)
        packed = gguf_quants.pack_gguf(raw, qtype, n, k)
        reference = torch.from_numpy(quants.dequantize(raw, qtype))
        for m in ROWS:
            assert_matmul_close(packed, reference, m, torch.float32)


def test_build_in_background_then_matmul():
    thread = kernels.build_in_background()
    thread.join(timeout=300)
    assert not thread.is_alive() and kernels.kernel_available()


# -- the GPU kernels (triton_group_mm.py): natively on a GPU, else in Triton's interpreter -----
# Every M runs the fused kernel: decode tiles up to FUSED_MAX_ROWS, prefill tiles at M = 100.


def triton_matmul(packed, x: torch.Tensor) -> torch.Tensor:
    """The custom op the engine calls on the GPU, on `packed`'s tensors."""
    z = packed.zeros
    return triton_ops.group_quantized_mm(
        x, packed.qweight, packed.scales, z, packed.bits, packed.group_size
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 40, 100])
@pytest.mark.parametrize("qtype, n, k", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_triton_group_mm_matches_reference(device, qtype, n, k, m, dtype):
    raw = gguf_blocks(qtype, n, k)
    packed = gguf_quants.pack_gguf(raw, qtype, n, k).to(device)
    reference = torch.from_numpy(quants.dequantize(raw, qtype))
    out = assert_matmul_close(packed, reference, m, dtype, triton_matmul, device)
    if device.type == "cuda":  # what a layer on the GPU runs: this op, same bits
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
        assert torch.equal(packed.matmul(x), out)


@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda v: v.name)
def test_triton_group_mm_splits_long_rows_over_programs(device, monkeypatch, qtype, m):
    # K = 2304: 18 steps of 128, split over 4 programs (640 columns each) when the (M, N) tiles
    # alone are few (and always at decode's few rows)
    monkeypatch.setattr(triton_group_mm, "_multiprocessors", lambda device: 8)
    n, k = 45, 2304
    raw = gguf_blocks(qtype, n, k)
    packed = gguf_quants.pack_gguf(raw, qtype, n, k).to(device)
    reference = torch.from_numpy(quants.dequantize(raw, qtype))
    out = assert_matmul_close(packed, reference, m, torch.float32, triton_matmul, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    assert torch.equal(triton_matmul(packed, x), out)  # a fixed order of partial sums
    w = packed
    whole = triton_group_mm.group_mm(x, w.qweight, w.scales, w.zeros, w.bits, w.group_size, split=1)
    assert not torch.equal(whole, out)  # no split: another summation order, same result
    assert torch.allclose(whole, out, rtol=1e-5, atol=1e-5 * out.abs().max().item())


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 32)])
def test_triton_group_mm_summed_in_registers_matches(device, bits, group_size, m):
    """The kernel's other form for a few rows (USE_DOT=False: products summed in registers, no
    16-row tensor-core tile), which benchmarks/group_mm_tiles.py times against tl.dot."""
    n, k = 45, 384
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    packed = kernels.pack_groups(*quantize_rtn(w, bits, group_size), bits, group_size).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    want = x.double() @ packed.dequantize().double().T
    for block_n, block_k, split in ((16, 128, None), (32, 64, 3)):
        tiles = dict(BLOCK_M=1 << (m - 1).bit_length(), BLOCK_N=block_n, BLOCK_K=block_k,
                     USE_DOT=False, num_warps=4, num_stages=2)  # fmt: skip
        y = triton_group_mm.group_mm(
            x, packed.qweight, packed.scales, packed.zeros, bits, group_size, tiles, split
        )
        assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("bits, group_size", [(4, 128), (8, 16)])
def test_triton_group_mm_other_group_sizes(device, bits, group_size):
    n, k = 77, 384
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    packed = kernels.pack_groups(*quantize_rtn(w, bits, group_size), bits, group_size)
    reference = packed.dequantize()
    assert_matmul_close(packed.to(device), reference, 7, torch.float32, triton_matmul, device)


def test_a_long_prefill_never_expands_the_whole_weight(device, monkeypatch):
    """Above 64 rows the fused kernel runs with prefill tiles: W stays packed (no call expands
    it whole, as the dequantize-then-GEMM path did on every call and every graph replay)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the whole weight was expanded")

    monkeypatch.setattr(triton_group_mm, "dequantize", refuse)
    raw = gguf_blocks(T.Q4_1, 70, 256)
    packed = gguf_quants.pack_gguf(raw, T.Q4_1, 70, 256).to(device)
    reference = torch.from_numpy(quants.dequantize(raw, T.Q4_1))
    assert_matmul_close(packed, reference, 200, torch.float32, triton_matmul, device)
