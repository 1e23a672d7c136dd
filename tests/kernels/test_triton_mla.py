"""The Triton MLA kernels (latent cache write, absorbed decode) against plain torch.

The reference attends each sequence's latent rows in float64: scores q_latent . latent +
q_pe . k_pe, values the latents. Cache slots no sequence wrote hold NaN, so a kernel reading past
a sequence's length, or a padded block-table entry, fails. Without CUDA the kernels run in
Triton's interpreter (conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from llmctl.engine.kernels.triton.triton_mla import mla_decode_attention, mla_write_cache

BLOCK_SIZE = 16
KV_LORA, ROPE = 64, 16


def paged_latents(seq_lens, dtype, device, max_blocks=None):
    """(cache [num_blocks, BLOCK_SIZE, KV_LORA + ROPE], block_tables, rows): random latent rows
    for each sequence in scattered blocks, NaN elsewhere; rows[i] is sequence i's [n, 80]."""
    g = torch.Generator().manual_seed(0)
    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    max_blocks = max_blocks or max(max(blocks), 1)
    num_blocks = sum(blocks) + 2
    cache = torch.full((num_blocks, BLOCK_SIZE, KV_LORA + ROPE), float("nan"), dtype=dtype)
    table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    for i, n in enumerate(seq_lens):
        ids = [free.pop() for _ in range(blocks[i])]
        table[i, : blocks[i]] = torch.tensor(ids, dtype=torch.int64)
        seq = torch.randn(n, KV_LORA + ROPE, generator=g).to(dtype)
        for t in range(n):
            cache[ids[t // BLOCK_SIZE], t % BLOCK_SIZE] = seq[t]
        rows.append(seq)
    return cache.to(device), table.to(device), rows


def reference(q_latent, q_pe, rows, scale):
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for i, seq in enumerate(rows):
        if not len(seq):
            continue
        q = torch.cat((q_latent[i], q_pe[i]), -1).double().cpu()  # [H, L + R]
        keys = seq.double()
        p = torch.softmax(q @ keys.T * scale, dim=-1)
        out[i] = p @ keys[:, :KV_LORA]
    return out


@pytest.mark.parametrize(
    "seq_lens, heads, max_blocks",
    [
        ([1, 15, 16, 17, 50, 0], 4, None),  # one partition; a padding row (seq_len 0)
        ([700, 33], 20, 48),  # few programs, a long table: split into partitions; 2 head blocks
    ],
)
def test_decode_matches_attention_over_the_latents(seq_lens, heads, max_blocks, device):
    cache, table, rows = paged_latents(seq_lens, torch.float32, device, max_blocks)
    g = torch.Generator().manual_seed(1)
    q_latent = torch.randn(len(seq_lens), heads, KV_LORA, generator=g).to(device)
    q_pe = torch.randn(len(seq_lens), heads, ROPE, generator=g).to(device)
    lens = torch.tensor(seq_lens, device=device)
    out = mla_decode_attention(q_latent, q_pe, cache, table, lens, 0.1)
    want = reference(q_latent, q_pe, rows, 0.1)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-5, rtol=1e-4)


def test_write_puts_rows_at_their_slots_and_skips_padding(device):
    cache = torch.zeros(4, BLOCK_SIZE, KV_LORA + ROPE, device=device)
    latent = torch.randn(3, KV_LORA, device=device)
    k_pe = torch.randn(3, ROPE, device=device)
    slots = torch.tensor([5, -1, 2 * BLOCK_SIZE + 3], device=device)
    mla_write_cache(latent, k_pe, cache, slots)
    flat = cache.view(-1, KV_LORA + ROPE)
    torch.testing.assert_close(flat[5], torch.cat((latent[0], k_pe[0])), atol=0, rtol=0)
    torch.testing.assert_close(flat[35], torch.cat((latent[2], k_pe[2])), atol=0, rtol=0)
    assert int((flat.abs().sum(-1) > 0).sum()) == 2  # the padding token wrote nothing
