"""Paged attention on the GPU: Triton kernels that read K and V straight from the block table.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; key_cache and
value_cache are its two halves, [num_blocks, block_size, num_kv_heads, head_dim] each (any
strides). Key position t of a sequence lives in block block_table[t // block_size], row
t % block_size; reshape_and_cache (triton_kv_cache.py, re-exported here) writes it. Query head h
reads KV head h // (num_heads // num_kv_heads). A query at position p sees the keys at positions
k <= p, and with a sliding window only those with k > p - sliding_window.

    paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window,
                           sinks)

One query token per sequence. q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs,
max_blocks] int32/int64, rows padded with any valid block id; seq_lens: [num_seqs] int32/int64,
the tokens visible to the query, itself included (the query is at position seq_len - 1). A row
with seq_len 0 (CUDA-graph padding) reads nothing and yields zeros. One program per (sequence,
KV head, partition) holds the group's query heads as the rows of one tl.dot (padded to 16), so
each K and V row is read once per group, and walks its keys BLOCK_N at a time with an online
softmax in float32. When the (sequence, KV head) programs would not fill the GPU twice over,
each sequence's keys are shared out among up to 64 partitions (flash-decoding) and a second
kernel merges their (max, sum, unnormalized output). How many partitions depends only on shapes
(decode_partitions: the programs, the GPU's size), so a captured CUDA graph stays valid for any
seq_lens; each partition's share is sized in the kernel from its sequence's own length, so a
2k-token context fills the GPU whether the block table is as wide as 2k or as max_model_len.

    prefill_attention(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                      context_lens, max_query_len, scale, window, sinks)

The step's prefill chunks, packed. q: [num_prefill_tokens, num_heads, head_dim]; chunk i owns q
rows query_start_loc[i]:query_start_loc[i + 1] (query_start_loc: [num_chunks + 1], from 0),
which sit at positions context_lens[i] .. seq_lens[i] - 1 of its sequence. Every key, the cached
prefix and the chunk's own (already written by reshape_and_cache), is read through
block_tables[i]: [num_chunks, max_blocks]. Plain prefill (context_len 0), a prefix-cache hit, a
later chunk of a chunked prefill and a one-token decode are the same call. One program per
(block of BLOCK_Q queries of a chunk, KV head) holds those queries of all the group's query heads
(BLOCK_M = BLOCK_Q x the group, padded to a power of two: 128 rows against 64-key tiles for
head_dim 128 in 16-bit), so each K and V tile is read once per group; key tiles that every query
of the block sees are read and attended without masks, only the causal diagonal's (and every
tile under a sliding window) are masked. The grid is (num_tokens // BLOCK_Q + num_chunks, KV
heads) and each program finds its chunk by a binary search of query_start_loc: it depends on
shapes only (max_query_len picks the tiles), so a CUDA graph of a mixed step replays it.

Both take optional sinks ([num_heads] float32, gpt-oss): head h's softmax then has exp(sinks[h])
in its denominator and nothing for it in the output (with partitions, added when they merge).
Both return a new contiguous tensor shaped like q, in q's dtype, which must be the cache's.
head_dim up to 256, any size (padded to a power of two with masks); float32 (IEEE dot products,
no TF32), float16, bfloat16. Tiles are fixed, no autotuning: decode reads about 8 KiB of K per
loop step (_key_tile); prefill_tiles halves its 128 x 64 as a head_dim row grows past 256 and
512 bytes (tests/kernels/test_triton_compile.py compiles them for sm_90: 16-byte asynchronous
copies of the K and V tiles, under 100 KiB of shared memory).
On CPU tensors the kernels run only under Triton's interpreter (TRITON_INTERPRET=1), whose
tl.dot cannot multiply bfloat16 (it holds them as raw uint16), so there bfloat16 tiles are
widened to float32 first. The kernels themselves are in triton_attention_kernels.py.
"""

from __future__ import annotations

import functools

import torch
import triton

from llmctl.engine.kernels.triton.triton_attention_kernels import (
    merge_partitions_kernel,
    paged_decode_kernel,
    varlen_attention_kernel,
)
from llmctl.engine.kernels.triton.triton_kv_cache import reshape_and_cache

__all__ = ["paged_decode_attention", "prefill_attention", "reshape_and_cache"]

_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634
_FEW_PROGRAMS = 128  # the interpreter's stand-in for 2 x the GPU's multiprocessors
_MAX_PARTITIONS = 64


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache; see the module doc."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group, block_d = _check_shapes(q, key_cache, value_cache)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    block_n = _key_tile(q.dtype, block_d)
    max_keys = block_tables.shape[1] * key_cache.shape[1]
    num_partitions = decode_partitions(num_seqs * num_kv_heads, max_keys, block_n, q.device)
    if num_partitions > 1:
        # [num_seqs, num_heads, num_partitions(, head_dim)] float32
        part_max = torch.empty((num_seqs, num_heads, num_partitions), device=q.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty((*part_max.shape, head_dim), device=q.device)
    else:
        part_max = part_sum = part_out = out  # unused: the kernel writes out directly
    paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        part_max,
        part_sum,
        part_out,
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        q if sinks is None else sinks,
        scale * _LOG2E,
        sliding_window or 0,
        *q.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        head_dim,
        key_cache.shape[1],
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_PARTITIONS=num_partitions,
        USE_WINDOW=bool(sliding_window),
        USE_SINKS=sinks is not None,
        UPCAST=_needs_upcast(q),
        DOT_PRECISION=_dot_precision(q),
        num_warps=8 if block_n * block_d >= 4096 else 4,
    )
    if num_partitions > 1:
        merge_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_max,
            part_sum,
            part_out,
            q if sinks is None else sinks,
            *out.stride(),
            head_dim,
            NUM_PARTITIONS=num_partitions,
            BLOCK_P=triton.next_power_of_2(num_partitions),
            BLOCK_D=block_d,
            USE_SINKS=sinks is not None,
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed prefill chunks over their paged KV cache; see the module doc."""
    num_tokens, num_heads, head_dim = q.shape
    group, block_d = _check_shapes(q, key_cache, value_cache)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_chunks = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_chunks == 0 or max_query_len == 0:
        return out
    tiles = prefill_tiles(q.dtype, block_d, group, max_query_len)
    block_q = tiles["BLOCK_M"] // tiles["GROUP_PAD"]
    # chunk c owns programs [qsl[c] // block_q + c, ...): a bound that depends on shapes only
    grid = (num_tokens // block_q + num_chunks, key_cache.shape[2])
    varlen_attention_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        context_lens,
        q if sinks is None else sinks,
        scale * _LOG2E,
        sliding_window or 0,
        num_chunks,
        *q.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        head_dim,
        key_cache.shape[1],
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_D=block_d,
        PAD_D=block_d != head_dim,
        USE_WINDOW=bool(sliding_window),
        USE_SINKS=sinks is not None,
        UPCAST=_needs_upcast(q),
        DOT_PRECISION=_dot_precision(q),
        **tiles,
    )
    return out


def prefill_tiles(dtype: torch.dtype, block_d: int, group: int, max_query_len: int) -> dict:
    """The prefill kernel's tiles: 128 query rows x 64 keys where a head_dim row is at most 256
    bytes (bf16/fp16 up to head_dim 128), halved as rows grow; the rows hold BLOCK_M / GROUP_PAD
    queries of all GROUP heads of a KV head; fewer rows for short chunks (16 at least, tl.dot's)."""
    row_bytes = block_d * dtype.itemsize
    block_m, block_n = (128, 64) if row_bytes <= 256 else (64, 32) if row_bytes <= 512 else (32, 16)
    group_pad = triton.next_power_of_2(group)
    block_m = min(block_m, max(16, triton.next_power_of_2(max_query_len * group_pad)))
    block_m = max(block_m, group_pad)
    return {
        "GROUP_PAD": group_pad,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "num_warps": 8 if block_m * block_d >= 8192 else 4,
    }


def decode_partitions(programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Key partitions of a decode (flash-decoding): where the (sequence, KV head) programs would
    not fill the GPU twice over, each sequence's keys are shared out among this many programs
    (each sizes its share from the sequence's own length, in the kernel); from shapes only, so a
    captured CUDA graph stays valid for any lengths."""
    target = 2 * _multiprocessors(device) if device.type == "cuda" else _FEW_PROGRAMS
    if programs >= target:
        return 1
    return max(
        1, min(triton.cdiv(target, programs), _MAX_PARTITIONS, triton.cdiv(max_keys, block_n))
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_shapes(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int]:
    """(query heads per KV head, head_dim padded to a power of two >= 16 for tl.dot)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if not q.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"q is {q.dtype} but the KV cache is {key_cache.dtype}/{value_cache.dtype}; "
            "the Triton attention kernels need one dtype (set the cache dtype to the model's)"
        )
    if key_cache.shape[-1] != head_dim:
        raise ValueError(f"q has head_dim={head_dim} but the KV cache {key_cache.shape[-1]}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "the KV cache must hold the KV heads this rank's query heads read"
        )
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim} is above the Triton attention kernels' limit of {_MAX_HEAD_DIM}"
        )
    return num_heads // num_kv_heads, max(16, triton.next_power_of_2(head_dim))


def _key_tile(dtype: torch.dtype, block_d: int) -> int:
    """Keys per loop step: about 8 KiB of K per tile, 16..64 rows."""
    return min(64, max(16, 8192 // (block_d * dtype.itemsize)))


def _needs_upcast(q: torch.Tensor) -> bool:
    # Triton's CPU interpreter stores bfloat16 as uint16 and its tl.dot multiplies the raw bits.
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _dot_precision(q: torch.Tensor) -> str:
    # float32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa).
    return "ieee" if q.dtype == torch.float32 else "tf32"
