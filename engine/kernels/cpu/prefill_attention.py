"""Causal prefill attention on the CPU in bfloat16 or float32 over the paged KV cache: a C++
kernel on oneDNN's brgemm (prefill_attention_cpu.cpp, built into the paged attention extension).

    prefill_attention(q, key_cache, value_cache, out, block_tables, chunks, scale, window)

q, out: [num_tokens, num_heads, head_dim], each token's heads contiguous (a view into the QKV
projection's output is fine); key_cache, value_cache: the layer's [num_blocks, block_size,
num_kv_heads, head_dim], the chunks' own keys and values already written; block_tables:
[rows, width] int64; chunks: the step's PrefillChunks (query_start, query_len, context_len and
index, the chunk's block table row). Query i of a chunk sits at position context_len + i and sees
the keys at positions <= its own (and > its own - window with a sliding window). Writes the
chunks' rows of out.

The kernel multiplies all the query heads of a KV head's group at once (AMX tiles where the CPU
has them, AVX512-BF16 dot products otherwise) with flash attention's online softmax: on SmolLM2's
16 x 512-token prefill on the Intel AMX kind it took the attention from torch's
scaled_dot_product_attention's 0.9 ms a sequence and layer to 0.56, and a chunk after cached
context (a prefix-cache hit, a chunked prefill's later chunks) reads its keys from the cache's
blocks where the torch backend gathered them and built a mask. The float32 flavour (the AVX2
path's layers; dtype="float32" anywhere) keeps P in float32: the bundled model's 16 x 512-token
prefill (W3) ran 1.13-1.16x as fast as with torch's kernel on the AVX2 path (emulated on Zen 4)
and 1.11-1.13x on Zen 4 in float32, where torch's kernel computes every key of its one 512-key
block for every query. `usable` says when it can run: a CPU layer whose queries and cache are
both bfloat16 (a build with AVX512-BF16) or both float32 (AVX2 and FMA), a head_dim that is a
multiple of 32 (at most 256), no sinks; the attention backend runs scaled_dot_product_attention
otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from llmctl.engine.attention.metadata import PrefillChunk
from llmctl.engine.kernels.cpu import paged_attention_cpu

_MAX_HEAD_DIM = 256


def usable(layer, q: torch.Tensor) -> bool:
    """Whether the kernel can run `layer`'s prefills for queries like `q`."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and layer.kv_cache.dtype == q.dtype
        and layer.kv_cache.is_contiguous()
        and layer.sinks is None
        and layer.head_dim % 32 == 0
        and layer.head_dim <= _MAX_HEAD_DIM
        and available(q.dtype)
    )


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: Sequence[PrefillChunk],
    scale: float,
    window: int | None = None,
) -> None:
    """Each chunk's causal attention over its sequence's cached keys, into `out`'s rows."""
    ops = _ops()
    if ops is None or not available(q.dtype):
        raise RuntimeError(
            f"the CPU prefill attention kernel is not built for {q.dtype}: check usable() first"
        )
    ops.prefill_attention(
        q,
        key_cache,
        value_cache,
        out,
        block_tables,
        [c.index for c in chunks],
        [c.query_start for c in chunks],
        [c.query_len for c in chunks],
        [c.context_len for c in chunks],
        scale,
        window,
    )


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether this machine's build has the kernel for `dtype`: bfloat16 needs AVX512-BF16,
    float32 AVX2 and FMA."""
    ops = _ops()
    if ops is None:
        return False
    if dtype == torch.bfloat16:
        return bool(ops.prefill_attention_available())
    return dtype == torch.float32 and bool(ops.prefill_attention_f32_available())


@functools.cache
def _ops():
    name = paged_attention_cpu.namespace()
    return None if name is None else getattr(torch.ops, name)
