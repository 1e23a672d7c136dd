"""The Triton paged-attention kernels against torch's scaled_dot_product_attention.

The reference gathers each sequence's blocks from the paged cache by its block table and runs
SDPA in float64 with an explicit mask (causal from the chunk's offset, plus the sliding window),
one sequence at a time. Every cache slot that no sequence wrote holds NaN, so a kernel that reads
a key outside a sequence's visible range, or a padded block-table entry, fails the comparison.
On a machine without CUDA the kernels run under Triton's interpreter (see conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmctl.engine.kernels.triton import triton_attention
from llmctl.engine.kernels.triton.triton_attention import (
    paged_decode_attention,
    prefill_attention,
    reshape_and_cache,
)

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
# (num_kv_heads, num_heads): GQA groups of 1, 3 and 8 query heads per KV head.
HEADS = [(2, 2), (2, 6), (1, 8)]
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DECODE_SEQ_LENS = [1, 15, 16, 17, 50, 0]
# (context_len, query_len): plain prefill, a prefix-cache hit, a later chunk of a chunked
# prefill (not block-aligned), one-token chunks, and a chunk spanning two query tiles.
PREFILL_CHUNKS = [(0, 17), (32, 5), (20, 30), (15, 1), (0, 1), (3, 70)]


class PagedCache:
    """One layer's [2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim] cache holding random keys
    and values for sequences of the given lengths in scattered blocks; the rest is NaN. Every
    sequence of a block or more starts with the same physical block (a shared cached prefix)."""

    def __init__(
        self, seq_lens, head_dim, dtype, device, *, num_kv_heads=NUM_KV_HEADS, max_blocks=None
    ):
        g = torch.Generator().manual_seed(0)
        blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
        max_blocks = max_blocks or max(max(blocks), 1)
        num_blocks = sum(blocks) + 3
        shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        kv = torch.full(shape, float("nan"), dtype=dtype)
        # Rows padded with random (valid, possibly unwritten or foreign) block ids.
        table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=g)
        free = torch.randperm(num_blocks, generator=g).tolist()
        shared = None
        for row, (n, num) in enumerate(zip(seq_lens, blocks, strict=True)):
            table[row, :num] = torch.tensor([free.pop() for _ in range(num)], dtype=torch.int64)
            if n >= BLOCK_SIZE:
                shared = table[row, 0].item() if shared is None else shared
                table[row, 0] = shared
            pos = torch.arange(n)
            blk, off = table[row, pos // BLOCK_SIZE], pos % BLOCK_SIZE
            kv[:, blk, off] = torch.randn(2, n, num_kv_heads, head_dim, generator=g).to(dtype)
        self.kv = kv.to(device)
        self.key_cache, self.value_cache = self.kv.unbind(0)
        self.block_tables = table.to(device=device, dtype=torch.int32)


def reference(
    q, cache: PagedCache, row, context_len, seq_len, scale, sliding_window=None, sinks=None
):
    """q: [query_len, num_heads, head_dim] at positions context_len .. seq_len - 1 -> float64.
    Sinks join as a zero key and value whose score is the head's sink (an additive mask)."""
    if seq_len == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    blocks = cache.block_tables[row, : math.ceil(seq_len / BLOCK_SIZE)].long().cpu()
    kv = cache.kv.cpu()[:, blocks].flatten(1, 2)[:, :seq_len].double()  # [2, seq_len, kv, d]
    q_pos = torch.arange(context_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    keys, values = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
    if sinks is not None:
        zero = keys.new_zeros(keys.shape[0], 1, keys.shape[-1])
        keys, values = torch.cat([keys, zero], 1), torch.cat([values, zero], 1)
        bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, mask.shape[0], 1)
        mask = torch.cat([bias.expand(len(sinks), *mask.shape), sink], dim=-1)
    out = F.scaled_dot_product_attention(
        q.cpu().double().transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def check_decode(
    seq_lens, heads, head_dim, dtype, device, *, window=None, max_blocks=None, sinks=None
):
    num_kv_heads, num_heads = heads
    cache = PagedCache(
        seq_lens, head_dim, dtype, device, num_kv_heads=num_kv_heads, max_blocks=max_blocks
    )
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(device, dtype)
    scale = head_dim**-0.5
    seq_lens_t = torch.tensor(seq_lens, device=device, dtype=torch.int32)
    out = paged_decode_attention(
        q,
        cache.key_cache,
        cache.value_cache,
        cache.block_tables,
        seq_lens_t,
        scale,
        window,
        None if sinks is None else sinks.to(device),
    )
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat(
        [
            reference(q[s : s + 1], cache, s, max(n - 1, 0), n, scale, window, sinks)
            for s, n in enumerate(seq_lens)
        ]
    )
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


def check_prefill(chunks, heads, head_dim, dtype, device, *, window=None, sinks=None):
    num_kv_heads, num_heads = heads
    seq_lens = [ctx + n for ctx, n in chunks]
    cache = PagedCache(seq_lens, head_dim, dtype, device, num_kv_heads=num_kv_heads)
    g = torch.Generator().manual_seed(2)
    query_lens = [n for _, n in chunks]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(device, dtype)
    query_start_loc = torch.tensor([0, *query_lens], device=device).cumsum(0)
    scale = head_dim**-0.5
    out = prefill_attention(
        q,
        cache.key_cache,
        cache.value_cache,
        cache.block_tables,
        query_start_loc,
        torch.tensor(seq_lens, device=device),
        torch.tensor([ctx for ctx, _ in chunks], device=device),
        max(query_lens),
        scale,
        window,
        None if sinks is None else sinks.to(device),
    )
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat(
        [
            reference(q[start : start + n], cache, i, ctx, ctx + n, scale, window, sinks)
            for i, ((ctx, n), start) in enumerate(
                zip(chunks, query_start_loc.tolist(), strict=False)
            )
        ]
    )
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_writes_slots_and_skips_negative_ones(dtype, device):
    num_blocks, head_dim, num_tokens = 5, 64, 7
    g = torch.Generator().manual_seed(0)
    # key and value are views into one fused qkv projection, as the model hands them over.
    qkv = torch.randn(num_tokens, 3 * NUM_KV_HEADS * head_dim, generator=g).to(device, dtype)
    key, value = (
        qkv[:, i * NUM_KV_HEADS * head_dim : (i + 1) * NUM_KV_HEADS * head_dim].view(
            num_tokens, NUM_KV_HEADS, head_dim
        )
        for i in (1, 2)
    )
    kv = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim), float("nan"))
    kv = kv.to(device, dtype)
    slot_mapping = torch.tensor([17, -1, 0, 79, 40, -1, 31], device=device)
    reshape_and_cache(key, value, kv[0], kv[1], slot_mapping)

    expected = torch.full_like(kv, float("nan"))
    written = slot_mapping >= 0
    flat = expected.view(2, -1, NUM_KV_HEADS, head_dim)
    flat[0, slot_mapping[written]] = key[written]
    flat[1, slot_mapping[written]] = value[written]
    torch.testing.assert_close(kv, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_sdpa(head_dim, heads, dtype, device):
    check_decode(DECODE_SEQ_LENS, heads, head_dim, dtype, device)


@pytest.mark.parametrize(("heads", "dtype"), [((2, 6), torch.float32), ((1, 8), torch.float16)])
def test_decode_sliding_window(heads, dtype, device):
    check_decode(DECODE_SEQ_LENS, heads, 64, dtype, device, window=20)


@pytest.mark.parametrize("window", [None, 100])
def test_decode_long_sequences_split_into_partitions(window, device):
    # Few sequences take the split-keys path and its merge kernel: each sequence's keys shared
    # out from its own length (the 5-token one leaves most partitions empty); the window of
    # the 600-token sequence straddles partition boundaries.
    max_blocks = 40
    assert triton_attention.decode_partitions(4 * 2, max_blocks * BLOCK_SIZE, 64, device) > 1
    check_decode(
        [600, 5, 0, 513], (2, 6), 64, torch.float32, device, window=window, max_blocks=max_blocks
    )


# gpt-oss's sinks: one per query head, some above every score (their exp dominates).
SINKS = torch.tensor([3.0, -2.0, 0.5, 9.0, -30.0, 1.5])


@pytest.mark.parametrize("window", [None, 20])
def test_decode_with_sinks(window, device):
    check_decode(DECODE_SEQ_LENS, (2, 6), 64, torch.float32, device, window=window, sinks=SINKS)


def test_sinks_join_when_partitions_merge(device):
    check_decode(
        [600, 5, 0, 513], (2, 6), 64, torch.float32, device, window=100, max_blocks=40, sinks=SINKS
    )


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_with_sinks(window, device):
    check_prefill(PREFILL_CHUNKS, (2, 6), 64, torch.float32, device, window=window, sinks=SINKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_sdpa(head_dim, heads, dtype, device):
    check_prefill(PREFILL_CHUNKS, heads, head_dim, dtype, device)


@pytest.mark.parametrize(("heads", "dtype"), [((2, 6), torch.float32), ((1, 8), torch.float16)])
def test_prefill_sliding_window(heads, dtype, device):
    check_prefill(PREFILL_CHUNKS, heads, 64, dtype, device, window=20)


def test_bfloat16(device):
    check_decode(DECODE_SEQ_LENS, (2, 6), 64, torch.bfloat16, device, window=20)
    check_prefill(PREFILL_CHUNKS, (2, 6), 64, torch.bfloat16, device)


@pytest.mark.parametrize("head_dim", [80, 256])
def test_head_dims_other_than_64_and_128(head_dim, device):
    check_decode(DECODE_SEQ_LENS, (2, 6), head_dim, torch.float16, device)
    check_prefill(PREFILL_CHUNKS, (2, 6), head_dim, torch.float16, device)


def test_decode_accepts_int64_metadata(device):
    seq_lens = [40, 3]
    cache = PagedCache(seq_lens, 64, torch.float32, device)
    q = torch.randn(2, 6, 64, device=device)
    args = (q, cache.key_cache, cache.value_cache)
    int32 = paged_decode_attention(
        *args, cache.block_tables, torch.tensor(seq_lens, device=device, dtype=torch.int32), 0.125
    )
    int64 = paged_decode_attention(
        *args, cache.block_tables.long(), torch.tensor(seq_lens, device=device), 0.125
    )
    torch.testing.assert_close(int64, int32, atol=0, rtol=0)


def test_a_cache_in_another_dtype_is_refused(device):
    cache = PagedCache([3], 64, torch.float16, device)
    q = torch.randn(1, 2, 64, device=device)
    with pytest.raises(ValueError, match="KV cache is torch.float16"):
        paged_decode_attention(
            q, cache.key_cache, cache.value_cache, cache.block_tables, torch.tensor([3]), 0.125
        )


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.float32), (80, torch.float16)])
def test_prefill_unmasked_interior_tiles(head_dim, dtype, device):
    """Long chunks: most key tiles lie wholly before a query block's first query and are read
    and attended without masks; the rest are on the causal diagonal. A prefix-cache hit of 200
    tokens, a 300-token prompt and a one-token decode among them; head_dim 80 pads to 128."""
    check_prefill([(200, 150), (0, 300), (130, 1)], (2, 6), head_dim, dtype, device)


def test_prefill_tiles_are_128_by_64_with_the_group_packed():
    tiles = triton_attention.prefill_tiles(torch.bfloat16, 128, 4, 8192)
    assert (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["GROUP_PAD"]) == (128, 64, 4)
    # a short chunk takes fewer rows; a wide head_dim, smaller tiles
    assert triton_attention.prefill_tiles(torch.bfloat16, 128, 4, 3)["BLOCK_M"] == 16
    assert triton_attention.prefill_tiles(torch.bfloat16, 256, 8, 8192)["BLOCK_M"] == 64
