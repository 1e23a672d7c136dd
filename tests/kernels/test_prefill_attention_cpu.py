"""The CPU prefill attention kernel (kernels/cpu/prefill_attention_cpu.cpp), in bfloat16 and in
float32, against a float64 oracle on odd shapes, and the CPU attention backend's use of it.

Chunks of 1, 7, 33, 70, 100 and 600 tokens (over the kernel's 512-key block: its online softmax
rescales; off its 32-key padding: its masks), first chunks and chunks after cached context, with
and without a sliding window, query-head groups of 1, 3 and 4, head_dim 32, 64 and 128, queries
read as views into a QKV row of odd width, keys and values from scattered blocks of a paged
cache. The backend sends all of a layer's chunks to the kernel in one call; layers with sinks
and odd head sizes stay with scaled_dot_product_attention.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from llmctl.engine.attention.backends.cpu import CPUAttentionBackend
from llmctl.engine.attention.backends.torch_sdpa import TorchSDPABackend
from llmctl.engine.attention.layer import Attention
from llmctl.engine.attention.metadata import AttentionMetadata, PrefillChunk
from llmctl.engine.kernels.cpu import paged_attention_cpu, prefill_attention
from llmctl.engine.platform import cpu_flags

# On a CPU with AVX512-BF16 the bfloat16 kernel must be there, on one with AVX2 and FMA the
# float32 one (a failed build fails these tests).
NEEDS_BF16 = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags(), reason="the bfloat16 prefill kernel needs AVX512-BF16"
)
NEEDS_F32 = pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_flags(), reason="the float32 prefill kernel needs AVX2 and FMA"
)
DTYPES = [
    pytest.param(torch.bfloat16, marks=NEEDS_BF16, id="bf16"),
    pytest.param(torch.float32, marks=NEEDS_F32, id="f32"),
]


BLOCK = 16


def qkv_views(tokens, heads, kv_heads, head_dim, seed=0, dtype=torch.bfloat16):
    """q, k, v as views into one [tokens, width] buffer whose rows are 3 values wider than the
    heads (an odd row stride, as a fused QKV projection with padding would give)."""
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size + 3, generator=g).to(dtype)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(tokens, kv_heads, head_dim)
    return q, k, v


class Case:
    """Prefill chunks of (context, length) tokens: each sequence's keys and values in scattered
    blocks of a paged cache, its chunk's queries (views into a QKV row) one after another."""

    def __init__(self, spec, heads, kv_heads, head_dim, seed=0, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        tokens = sum(n for _, n in spec)
        self.q, _, _ = qkv_views(tokens + 4, heads, kv_heads, head_dim, seed, dtype)  # 4 spare
        blocks = [-(-(ctx + n) // BLOCK) for ctx, n in spec]
        ids = torch.randperm(sum(blocks) + 2, generator=g).tolist()
        shape = (sum(blocks) + 2, BLOCK, kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=g).to(dtype)
        self.value_cache = torch.randn(shape, generator=g).to(dtype)
        self.block_tables = torch.zeros(len(spec) + 1, max(blocks) + 1, dtype=torch.int64)
        self.chunks, start = [], 0
        for i, ((ctx, n), count) in enumerate(zip(spec, blocks, strict=True)):
            row = 1 + i  # table row 0 unused: chunk i reads its own row
            self.block_tables[row, :count] = torch.tensor([ids.pop() for _ in range(count)])
            self.chunks.append(PrefillChunk(start, n, ctx + n, ctx, row))
            start += n

    def keys(self, chunk, cache):
        pos = torch.arange(chunk.seq_len)
        slots = self.block_tables[chunk.index, pos // BLOCK] * BLOCK + pos % BLOCK
        return cache.reshape(-1, *cache.shape[2:])[slots]  # [seq_len, kv_heads, head_dim]

    def run(self, scale, window=None):
        out = torch.full(self.q.shape, 7.0, dtype=self.q.dtype)
        prefill_attention.prefill_attention(
            self.q,
            self.key_cache,
            self.value_cache,
            out,
            self.block_tables,
            self.chunks,
            scale,
            window,
        )
        return out

    def oracle(self, scale, window=None):
        """float64 softmax(q k^T * scale) v over each query's visible keys; other rows NaN."""
        out = torch.full(self.q.shape, float("nan"), dtype=torch.float64)
        group = self.q.shape[1] // self.key_cache.shape[2]
        for c in self.chunks:
            k = self.keys(c, self.key_cache).double().repeat_interleave(group, 1)
            v = self.keys(c, self.value_cache).double().repeat_interleave(group, 1)
            q = self.q[c.query_start : c.query_start + c.query_len].double()
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            q_pos = torch.arange(c.context_len, c.seq_len)[:, None]
            k_pos = torch.arange(c.seq_len)[None, :]
            seen = k_pos <= q_pos
            if window is not None:
                seen &= k_pos > q_pos - window
            scores.masked_fill_(~seen, float("-inf"))
            rows = slice(c.query_start, c.query_start + c.query_len)
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out


def assert_close_to(out, want, rows, values):
    """bfloat16: each probability and each output is rounded to bfloat16 (8 significant bits)
    once: an output is off by at most 2^-9 of itself plus 2^-9 of the largest value it averages
    (the probabilities' roundings, summed); twice that is allowed. float32 (24 bits): the exp's
    ulp and the float32 sums over up to 600 keys, 2^-16 of the same."""
    err = (out[:rows].double() - want[:rows]).abs()
    unit = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-16
    bound = unit * (want[:rows].abs() + values.abs().max().item())
    assert (err <= bound).all(), f"max error {err.max().item()}"
    assert torch.equal(out[rows:], torch.full_like(out[rows:], 7.0))  # rows of no chunk


# (context, length): first chunks, a chunk over the kernel's 512-key block (its online softmax
# rescales), one token, chunks after cached context (a prefix-cache hit, a later chunk) of
# lengths off the 32-key padding
SPEC = [(0, 7), (0, 600), (20, 1), (530, 33), (0, 100), (45, 70)]


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(9, 3, 64), (4, 4, 32), (8, 2, 128)],
    ids=["group3-d64", "group1-d32", "group4-d128"],
)
@pytest.mark.parametrize("window", [None, 100, 40], ids=["causal", "window100", "window40"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_float64(heads, kv_heads, head_dim, window, dtype):
    case = Case(SPEC, heads, kv_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    assert_close_to(
        case.run(scale, window),
        case.oracle(scale, window),
        sum(n for _, n in SPEC),
        case.value_cache,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_chunks_as_torchs_kernel(dtype):
    """Where scaled_dot_product_attention takes a chunk (no context, causal), the kernel is no
    further from float64 than torch's own kernel in the same dtype, within a rounding."""
    case = Case([(0, 300), (0, 45)], 9, 3, 64, seed=4, dtype=dtype)
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    out, want = case.run(0.125), case.oracle(0.125)
    for c in case.chunks:
        rows = slice(c.query_start, c.query_start + c.query_len)
        k, v = (case.keys(c, x)[None].transpose(1, 2) for x in (case.key_cache, case.value_cache))
        torch_out = F.scaled_dot_product_attention(
            case.q[rows][None].transpose(1, 2), k, v, is_causal=True, scale=0.125, enable_gqa=True
        )[0].transpose(0, 1)
        torch_err = (torch_out.double() - want[rows]).abs().max().item()
        assert (out[rows].double() - want[rows]).abs().max().item() <= torch_err + rounding


# A KV head's packed slab in bytes for the wave test's chunks (40, 90 after 30, and 130 keys):
# bfloat16, 4-byte words x head_dim x the keys padded to 32 and one block more (96 + 160 + 192);
# float32, K^T and V, 8 bytes x head_dim x the keys padded to 8 (40 + 120 + 136)
SLAB_BYTES = {torch.bfloat16: 4 * 64 * (96 + 160 + 192), torch.float32: 8 * 64 * (40 + 120 + 136)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_heads_in_waves_give_the_same_bits(dtype):
    """Packed keys and values over max_packed_bytes (64 MB by default: a context of ~100K tokens)
    go one wave of KV heads at a time: the same tasks, the same output bits."""
    case = Case([(0, 40), (30, 90), (0, 130)], 8, 4, 64, seed=6, dtype=dtype)
    ops = prefill_attention._ops()
    outs = []
    for budget in (None, 1, 2 * SLAB_BYTES[dtype] + 1):  # all heads; one a wave; two a wave
        out = torch.full(case.q.shape, 7.0, dtype=dtype)
        ops.prefill_attention(
            case.q, case.key_cache, case.value_cache, out, case.block_tables,
            [c.index for c in case.chunks], [c.query_start for c in case.chunks],
            [c.query_len for c in case.chunks], [c.context_len for c in case.chunks],
            0.125, None, budget,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_close_to(outs[0], case.oracle(0.125), 260, case.value_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_and_a_single_token(dtype):
    """Scores in the hundreds (a scale of 1): the running maximum keeps every exp finite; a
    first chunk of one token attends to itself only: its value, exactly. In float32 a score's
    own rounding (its ulp, near 2^-24 of the hundreds) moves its exp by more than the small
    scores' bound: there the kernel is held to torch's float32 kernel's error, within 2^-20."""
    case = Case([(0, 519), (0, 1)], 2, 1, 32, seed=1, dtype=dtype)
    case.q.mul_(8)
    case.key_cache.mul_(8)
    out, want = case.run(1.0), case.oracle(1.0)
    assert torch.isfinite(out[:520]).all()
    if dtype == torch.bfloat16:
        assert_close_to(out, want, 520, case.value_cache)
    else:
        first = case.chunks[0]
        k, v = (
            case.keys(first, x)[None].transpose(1, 2) for x in (case.key_cache, case.value_cache)
        )
        torch_out = F.scaled_dot_product_attention(
            case.q[:519][None].transpose(1, 2), k, v, is_causal=True, scale=1.0
        )[0].transpose(0, 1)
        torch_err = (torch_out.double() - want[:519]).abs().max().item()
        assert (out[:519].double() - want[:519]).abs().max().item() <= torch_err + 2.0**-20
    last = case.chunks[1]
    assert torch.equal(out[519], case.keys(last, case.value_cache)[0].expand(2, 32))


@NEEDS_BF16
def test_bad_input_is_refused_by_name():
    case = Case([(0, 8), (3, 5)], 4, 2, 64)
    out = torch.empty_like(case.q)
    call = prefill_attention.prefill_attention
    with pytest.raises(RuntimeError, match="chunk 0 .* is outside q"):
        chunks = [PrefillChunk(10, 8, 8, 0, 1)]
        call(case.q, case.key_cache, case.value_cache, out, case.block_tables, chunks, 0.1)
    with pytest.raises(RuntimeError, match="block table row cannot hold 900 tokens"):
        chunks = [PrefillChunk(0, 8, 900, 892, 1)]
        call(case.q, case.key_cache, case.value_cache, out, case.block_tables, chunks, 0.1)
    with pytest.raises(RuntimeError, match="block id 99 is outside the KV cache"):
        tables = case.block_tables.clone()
        tables[1, 0] = 99
        call(case.q, case.key_cache, case.value_cache, out, tables, case.chunks, 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(case.q.float(), case.key_cache, case.value_cache, out, case.block_tables, [], 0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_runs_every_chunk_in_one_call(monkeypatch, dtype):
    """First chunks, one after 20 cached tokens, one longer than the window: one kernel call per
    layer, the cache written as the torch backend writes it, the output within the dtype's
    rounding of the torch backend's (gathered keys, masked SDPA)."""
    heads, kv_heads, head_dim = 6, 2, 64
    spec = [(0, 40), (20, 30), (0, 50), (0, 90)]
    case = Case(spec, heads, kv_heads, head_dim, seed=2, dtype=dtype)
    tokens = sum(n for _, n in spec)
    _, k, v = qkv_views(tokens, heads, kv_heads, head_dim, seed=3, dtype=dtype)
    slots = []
    for c in case.chunks:
        pos = torch.arange(c.context_len, c.seq_len)
        slots.append(case.block_tables[c.index, pos // BLOCK] * BLOCK + pos % BLOCK)
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decodes=0,
        prefills=case.chunks,
        prefill_block_tables=case.block_tables,
    )
    layer = Attention(heads, head_dim, head_dim**-0.5, kv_heads, sliding_window=64)
    calls = []
    real = prefill_attention.prefill_attention
    monkeypatch.setattr(
        prefill_attention,
        "prefill_attention",
        lambda *a: calls.append([c.index for c in a[5]]) or real(*a),
    )
    q = case.q[:tokens]
    results = {}
    for backend in (CPUAttentionBackend(), TorchSDPABackend()):
        layer.kv_cache = torch.stack([case.key_cache, case.value_cache])
        results[backend.name] = (backend.forward(layer, q, k, v, md), layer.kv_cache)
    assert calls == [[c.index for c in case.chunks]]
    (ours, our_cache), (theirs, their_cache) = results["cpu"], results["torch"]
    assert torch.equal(our_cache, their_cache)  # the same keys and values written
    assert (ours.double() - theirs.double()).abs().max().item() <= (
        2.0**-6 if dtype == torch.bfloat16 else 2.0**-18
    )


@NEEDS_F32
def test_float32_layers_take_the_kernel_sinks_and_odd_heads_stay_with_torch():
    layer = Attention(4, 64, 0.125, 2)
    layer.kv_cache = torch.zeros(2, 1, 16, 2, 64)
    assert prefill_attention.usable(layer, torch.zeros(1, dtype=torch.float32))
    assert not prefill_attention.usable(layer, torch.zeros(1, dtype=torch.float16))
    layer_sinks = Attention(4, 64, 0.125, 2, sinks=True)
    assert not prefill_attention.usable(layer_sinks, torch.zeros(1, dtype=torch.float32))
    assert not prefill_attention.usable(
        Attention(4, 48, 0.125, 2), torch.zeros(1, dtype=torch.float32)
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 build variants")
@pytest.mark.skipif("avx512bw" not in cpu_flags(), reason="needs AVX-512")
def test_a_build_without_avx512_bf16_says_so():
    """A build for a CPU without AVX512-BF16 has the op, answers False, and refuses to run."""
    ops = getattr(torch.ops, paged_attention_cpu.build_namespace("native", ("-mno-avx512bf16",)))
    assert ops.prefill_attention_available() is False
    case = Case([(0, 8)], 4, 2, 64)
    with pytest.raises(RuntimeError, match="built without AVX512-BF16"):
        ops.prefill_attention(
            case.q,
            case.key_cache,
            case.value_cache,
            torch.empty_like(case.q),
            case.block_tables,
            [1],
            [0],
            [8],
            [0],
            0.1,
        )
