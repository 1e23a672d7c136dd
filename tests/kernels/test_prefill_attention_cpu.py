"""The CPU prefill attention kernel (kernels/cpu/prefill_attention_cpu.cpp) against a float64
oracle on odd shapes, and the CPU attention backend's choice of chunks for it.

Chunks of 1, 7, 33, 100 and 600 tokens (over the kernel's 512-key block: its online softmax
rescales; under its 32-key padding: its masks), query-head groups of 1, 3 and 4, head_dim 32, 64
and 128, queries, keys and values read as views into one QKV row of odd width. The backend sends
a layer's first chunks to the kernel in one call and keeps scaled_dot_product_attention for a
chunk after cached context and for one longer than the sliding window: those come out bit for bit
as the torch backend's.
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

pytestmark = pytest.mark.skipif(
    not prefill_attention.usable(Attention(2, 64, 0.125, 1), torch.zeros(1, dtype=torch.bfloat16)),
    reason="the prefill kernel needs a build with AVX512-BF16 (this CPU has none)",
)


def qkv_views(tokens, heads, kv_heads, head_dim, seed=0):
    """q, k, v as views into one [tokens, width] bfloat16 buffer whose rows are 3 values wider
    than the heads (an odd row stride, as a fused QKV projection with padding would give)."""
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size + 3, generator=g).to(torch.bfloat16)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(tokens, kv_heads, head_dim)
    return q, k, v


def oracle(q, k, v, chunks, scale):
    """float64 causal softmax(q k^T * scale) v per chunk; rows outside the chunks stay NaN."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for start, n in chunks:
        qq, kk, vv = (x[start : start + n].double().transpose(0, 1) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        scores = qq @ kk.transpose(-1, -2) * scale
        scores.masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out[start : start + n] = (scores.softmax(-1) @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(9, 3, 64), (4, 4, 32), (8, 2, 128)],
    ids=["group3-d64", "group1-d32", "group4-d128"],
)
def test_kernel_matches_float64(heads, kv_heads, head_dim):
    chunks = [(0, 7), (7, 600), (607, 1), (608, 33), (641, 100)]  # 741 tokens
    q, k, v = qkv_views(750, heads, kv_heads, head_dim)
    out = torch.full((750, heads, head_dim), 7.0, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    prefill_attention.prefill_attention(q, k, v, out, chunks, scale)
    want = oracle(q, k, v, chunks, scale)
    assert torch.equal(out[741:], torch.full_like(out[741:], 7.0))  # rows of no chunk untouched
    err = (out[:741].double() - want[:741]).abs()
    # The output and the probabilities are rounded to bfloat16 (8 bits) once each.
    assert err.max().item() <= 2.0**-7 * want[:741].abs().max().item()
    assert err.mean().item() <= 2.0**-9 * want[:741].abs().mean().item()
    # no worse than torch's own bfloat16 kernel on the same inputs, within a rounding
    for start, n in chunks:
        rows = slice(start, start + n)
        torch_out = F.scaled_dot_product_attention(
            *(x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
            is_causal=True,
            scale=scale,
            enable_gqa=heads != kv_heads,
        )[0].transpose(0, 1)
        torch_err = (torch_out.double() - want[rows]).abs().max().item()
        assert err[rows.start : rows.stop].max().item() <= torch_err + 2.0**-8


def test_large_scores_and_a_single_token():
    """Scores in the hundreds (a scale of 1): the running maximum keeps every exp finite; a
    chunk of one token attends to itself only, its value exactly."""
    q, k, v = qkv_views(520, 2, 1, 32, seed=1)
    q, k = q * 8, k * 8
    out = torch.empty(520, 2, 32, dtype=torch.bfloat16)
    prefill_attention.prefill_attention(q, k, v, out, [(0, 519), (519, 1)], 1.0)
    want = oracle(q, k, v, [(0, 519), (519, 1)], 1.0)
    assert torch.isfinite(out).all()
    assert (out.double() - want).abs().max().item() <= 2.0**-7 * want.abs().max().item()
    assert torch.equal(out[519], v[519].expand(2, 32))


def test_bad_input_is_refused_by_name():
    q, k, v = qkv_views(8, 4, 2, 64)
    out = torch.empty(8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="chunk 0 .* is outside q"):
        prefill_attention.prefill_attention(q, k, v, out, [(4, 5)], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        prefill_attention.prefill_attention(q.float(), k, v, out, [(0, 8)], 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q2, k2, v2 = qkv_views(8, 4, 2, 48)
        prefill_attention.prefill_attention(q2, k2, v2, torch.empty_like(q2), [(0, 8)], 0.125)


def run_backend(backend, layer, q, k, v, md):
    layer.kv_cache = layer_cache = layer.kv_cache.clone()
    out = backend.forward(layer, q, k, v, md)
    return out, layer_cache


def test_backend_sends_first_chunks_to_the_kernel(monkeypatch):
    """Chunks 0 and 2 start their sequences: one kernel call. Chunk 1 follows 20 cached tokens
    and chunk 3 is longer than the window: scaled_dot_product_attention, as the torch backend."""
    block_size, heads, kv_heads, head_dim = 16, 6, 2, 64
    lens = [40, 30, 50, 70]
    contexts = [0, 20, 0, 0]
    q, k, v = qkv_views(sum(lens), heads, kv_heads, head_dim, seed=2)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    chunks, slots, tables = [], [], []
    next_block = 0
    for i, (n, ctx) in enumerate(zip(lens, contexts, strict=True)):
        blocks = list(range(next_block, next_block + -(-(ctx + n) // block_size)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (8 - len(blocks)))
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)
        ]
        chunks.append(PrefillChunk(starts[i], n, ctx + n, ctx, i))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=0,
        prefills=chunks,
        prefill_block_tables=torch.tensor(tables),
    )
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, next_block, block_size, kv_heads, head_dim, generator=g)
    layer = Attention(heads, head_dim, head_dim**-0.5, kv_heads, sliding_window=64)
    layer.kv_cache = cache.to(torch.bfloat16)
    calls = []
    real = prefill_attention.prefill_attention
    monkeypatch.setattr(
        prefill_attention,
        "prefill_attention",
        lambda *a: calls.append(a[4]) or real(*a),
    )
    ours, our_cache = run_backend(CPUAttentionBackend(), layer, q, k, v, md)
    theirs, their_cache = run_backend(TorchSDPABackend(), layer, q, k, v, md)
    assert calls == [[(starts[0], lens[0]), (starts[2], lens[2])]]
    assert torch.equal(our_cache, their_cache)  # the same keys and values written
    for i in (1, 3):
        rows = slice(starts[i], starts[i] + lens[i])
        assert torch.equal(ours[rows], theirs[rows])
    for i in (0, 2):
        rows = slice(starts[i], starts[i] + lens[i])
        assert (ours[rows].double() - theirs[rows].double()).abs().max().item() <= 2.0**-6


def test_float32_and_sinks_stay_with_torch():
    layer = Attention(4, 64, 0.125, 2)
    assert not prefill_attention.usable(layer, torch.zeros(1, dtype=torch.float32))
    layer_sinks = Attention(4, 64, 0.125, 2, sinks=True)
    assert not prefill_attention.usable(layer_sinks, torch.zeros(1, dtype=torch.bfloat16))
    assert not prefill_attention.usable(
        Attention(4, 48, 0.125, 2), torch.zeros(1, dtype=torch.bfloat16)
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 build variants")
@pytest.mark.skipif("avx512bw" not in cpu_flags(), reason="needs AVX-512")
def test_a_build_without_avx512_bf16_says_so():
    """A build for a CPU without AVX512-BF16 has the op, answers False, and refuses to run."""
    ops = getattr(torch.ops, paged_attention_cpu.build_namespace("native", ("-mno-avx512bf16",)))
    assert ops.prefill_attention_available() is False
    q, k, v = qkv_views(8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="built without AVX512-BF16"):
        ops.prefill_attention(q, k, v, torch.empty(8, 4, 64, dtype=torch.bfloat16), [0], [8], 0.1)
