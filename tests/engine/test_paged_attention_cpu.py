"""The CPU paged decode attention kernel and its gather + SDPA fallback against a float64 oracle.

The oracle gathers each sequence's keys and values slot by slot from its block table and computes
softmax(q k^T * scale) v in float64. The kernel is built for real (build_kernel raises if it
cannot be), so these tests fail on a machine where the engine would silently fall back.
"""

from __future__ import annotations

import logging
import platform
import threading

import pytest
import torch

from llmctl.engine.kernels.cpu import paged_attention_cpu as pa
from llmctl.engine.platform import cpu_flags

BLOCK_SIZE = 16
SEQ_LENS = [1, 15, 16, 17, 100]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_case(seq_lens, num_kv_heads, group, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    # Scattered, non-overlapping blocks; rows padded with (valid) random ids.
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.randint(0, num_blocks, (len(seq_lens), max(blocks)), generator=g)
    for row, n in enumerate(blocks):
        table[row, :n] = torch.tensor([ids.pop() for _ in range(n)])
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    return q, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int64)


def reference(
    q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=None, sinks=None
):
    """softmax over the visible keys' scores (and each head's sink, weighing nothing) times V."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    flat_k = key_cache.reshape(-1, num_kv_heads, head_dim).double()
    flat_v = value_cache.reshape(-1, num_kv_heads, head_dim).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        if sliding_window is not None:
            pos = pos[pos > n - 1 - sliding_window]
        slots = block_tables[s, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k = flat_k[slots].repeat_interleave(group, dim=1)  # [keys, num_heads, head_dim]
        v = flat_v[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[s].double(), k) * scale
        if sinks is not None:  # one more column, the sink's, dropped after the softmax
            scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
        probs = scores.softmax(-1)[:, : len(pos)]
        out[s] = torch.einsum("hk,khd->hd", probs, v)
    return out


@pytest.fixture(scope="module")
def kernel():
    return pa.build_kernel()


def assert_close(out, expected, dtype):
    assert out.dtype == dtype
    assert out.shape == expected.shape
    err = (out.double() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err}"


CASES = pytest.mark.parametrize(
    "dtype, group, head_dim, sliding_window",
    [
        (dtype, group, head_dim, window)
        for dtype in (torch.float32, torch.bfloat16)
        for group in (1, 3)
        for head_dim in (64, 16)
        for window in (None, 16)
    ],
)


@CASES
def test_kernel_matches_reference(kernel, dtype, group, head_dim, sliding_window):
    case = make_case(SEQ_LENS, 2, group, head_dim, dtype)
    out = kernel(*case, 0.3, sliding_window)
    assert_close(out, reference(*case, 0.3, sliding_window), dtype)


@CASES
def test_fallback_matches_reference(dtype, group, head_dim, sliding_window):
    case = make_case(SEQ_LENS, 2, group, head_dim, dtype)
    out = pa.paged_decode_attention_sdpa(*case, 0.3, sliding_window)
    assert_close(out, reference(*case, 0.3, sliding_window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 16])
def test_sinks_in_kernel_and_fallback(kernel, dtype, sliding_window):
    """gpt-oss's sinks: large ones (the softmax's max) and small ones, with and without a window;
    the kernel and the torch fallback both match the oracle."""
    case = make_case(SEQ_LENS, 2, 3, 64, dtype)
    sinks = torch.tensor([3.0, -2.0, 0.5, 9.0, -30.0, 1.5])
    expected = reference(*case, 0.3, sliding_window, sinks)
    assert_close(kernel(*case, 0.3, sliding_window, sinks), expected, dtype)
    assert_close(pa.paged_decode_attention_sdpa(*case, 0.3, sliding_window, sinks), expected, dtype)
    without = reference(*case, 0.3, sliding_window)
    assert (expected - without).abs().max() > 0.1  # the sinks matter in this case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_split_across_threads(kernel, dtype):
    """64 sequences of SmolLM2's shapes: enough work that both threads take a share."""
    lens = [160 - 7 * (i % 9) for i in range(64)]
    case = make_case(lens, 3, 3, 64, dtype, seed=1)
    out = kernel(*case, 0.125, None)
    assert_close(out, reference(*case, 0.125), dtype)
    single = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(*case, 0.125, None), out)  # a thread split changes no bits
    finally:
        torch.set_num_threads(single)


def test_odd_head_dim_and_strided_query(kernel):
    """head_dim 40 (a partial vector) and q as the view of a fused qkv projection."""
    q, key_cache, value_cache, table, lens = make_case(SEQ_LENS, 2, 3, 40, torch.float32)
    qkv = torch.randn(q.shape[0], q.shape[1] * 40 + 2 * 2 * 40)
    qkv[:, : q.shape[1] * 40] = q.reshape(q.shape[0], -1)
    strided_q = qkv[:, : q.shape[1] * 40].view(q.shape)
    assert not strided_q.is_contiguous()
    out = kernel(strided_q, key_cache, value_cache, table, lens, 0.3, None)
    assert_close(out, reference(q, key_cache, value_cache, table, lens, 0.3), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(8, 4, 128), (1, 8, 96), (2, 2, 256)])
def test_larger_heads(kernel, dtype, num_kv_heads, group, head_dim):
    case = make_case(SEQ_LENS, num_kv_heads, group, head_dim, dtype)
    out = kernel(*case, head_dim**-0.5, None)
    assert_close(out, reference(*case, head_dim**-0.5), dtype)


def test_public_function_uses_the_kernel():
    case = make_case(SEQ_LENS, 1, 3, 64, torch.bfloat16)
    assert pa.kernel_available()
    out = pa.paged_decode_attention(*case, 0.3, 16)
    assert_close(out, reference(*case, 0.3, 16), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_write_puts_each_row_in_its_slot(kernel, dtype):
    """write_kv_cache against index_copy_: strided k and v (views into one QKV row), scattered
    slots, a padding slot (-1) left unwritten; a slot past the cache is refused by name."""
    g = torch.Generator().manual_seed(5)
    shape = (6, BLOCK_SIZE, 2, 40)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    qkv = torch.randn(9, 3 * 80 + 1, generator=g).to(dtype)
    k, v = qkv[:, 80:160].view(9, 2, 40), qkv[:, 160:240].view(9, 2, 40)
    slots = torch.tensor([17, 3, 95, -1, 40, 41, 0, 64, 88])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    valid = slots >= 0
    want_k.view(-1, 2, 40).index_copy_(0, slots[valid], k[valid])
    want_v.view(-1, 2, 40).index_copy_(0, slots[valid], v[valid])
    assert pa.write_kv_cache(key_cache, value_cache, k, v, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    with pytest.raises(RuntimeError, match="slot 96 is outside the KV cache"):
        pa.write_kv_cache(key_cache, value_cache, k, v, slots.clamp(max=96) + (slots == 95))


def test_out_of_range_block_id_is_refused(kernel):
    q, key_cache, value_cache, table, lens = make_case(SEQ_LENS, 2, 1, 16, torch.float32)
    table[4, 6] = key_cache.shape[0]  # the last block of the 100-token sequence
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        kernel(q, key_cache, value_cache, table, lens, 0.3, None)


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    def broken_build():
        raise RuntimeError("Error building extension\nfoo.cpp:1:1: error: no compiler here")

    monkeypatch.setattr(pa, "build_namespace", broken_build)
    pa._kernel.cache_clear()
    pa.namespace.cache_clear()
    try:
        case = make_case(SEQ_LENS, 2, 3, 64, torch.float32)
        with caplog.at_level(logging.WARNING, logger="llmctl"):
            first = pa.paged_decode_attention(*case, 0.3, None)
            second = pa.paged_decode_attention(*case, 0.3, None)
            assert not pa.kernel_available()
        assert_close(first, reference(*case, 0.3), torch.float32)
        assert torch.equal(first, second)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "error: no compiler here" in warnings[0].getMessage()
    finally:
        pa._kernel.cache_clear()
        pa.namespace.cache_clear()


def test_stale_torch_lock_does_not_hang(kernel):
    """torch's build lock is a plain file: a build killed mid-way leaves it, and every later
    cpp_extension.load() of that directory would wait on it forever."""
    build_dir = pa._build_root() / pa._build_spec("native", ())[0]
    (build_dir / "built.ok").unlink()  # as if the build never finished
    (build_dir / "lock").touch()
    result = {}
    worker = threading.Thread(target=lambda: result.update(op=pa.build_kernel()), daemon=True)
    worker.start()
    worker.join(timeout=300)
    assert "op" in result, "build_kernel() is stuck on the stale lock file"
    assert (build_dir / "built.ok").exists()
    assert not (build_dir / "lock").exists()


# Builds without AVX-512 or without AVX512-BF16 take the kernel's other code paths; each is a
# separate compile (~10 s, then cached).
VARIANTS = [
    pytest.param(
        "x86-64-v3",
        (),
        marks=pytest.mark.skipif("avx2" not in cpu_flags(), reason="needs AVX2"),
        id="portable",
    ),
    pytest.param(
        "native",
        ("-mno-avx512bf16",),
        marks=pytest.mark.skipif("avx512bw" not in cpu_flags(), reason="needs AVX-512"),
        id="avx512-without-bf16",
    ),
]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 build variants")
@pytest.mark.parametrize("march, extra_cflags", VARIANTS)
def test_other_instruction_sets(march, extra_cflags):
    kernel = pa.build_kernel(march, extra_cflags)
    for dtype in (torch.float32, torch.bfloat16):
        for group, head_dim, window in ((3, 64, None), (1, 40, 16)):
            case = make_case(SEQ_LENS, 2, group, head_dim, dtype)
            out = kernel(*case, 0.3, window)
            assert_close(out, reference(*case, 0.3, window), dtype)


def test_build_command_compiles_ahead_of_the_first_start(kernel, capsys):
    """`make setup` runs this so that the first engine start finds the kernel built."""
    from llmctl.engine.kernels.cpu.paged_attention_cpu import main

    assert main(["--build"]) == 0
    assert "CPU paged attention kernel ready in" in capsys.readouterr().out
