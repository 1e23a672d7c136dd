"""Causal prefill attention on the CPU in bfloat16: a C++ kernel on oneDNN's brgemm
(prefill_attention_cpu.cpp, built into the paged attention extension) for the prefill chunks that
start a sequence.

    prefill_attention(q, k, v, out, chunks, scale)

q, out: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], each
token's heads contiguous (a view into the QKV projection's output is fine); chunks: (first token,
length) of each chunk, each causal from its sequence's position 0. Writes those rows of out.

The kernel multiplies all the query heads of a KV head's group at once (AMX tiles where the CPU has
them, AVX512-BF16 dot products otherwise) with flash attention's online softmax; on SmolLM2's
16 x 512-token prefill on the Intel AMX kind it took the attention from torch's
scaled_dot_product_attention's 0.9 ms a sequence and layer to ~0.3. `usable` says when it can run:
a CPU bfloat16 layer with a head_dim that is a multiple of 32 (at most 256), no sinks, and a build
with AVX512-BF16; chunks after a prefix-cache hit or an earlier chunk, or longer than the layer's
sliding window, stay with scaled_dot_product_attention (the attention backend decides per chunk).
"""

from __future__ import annotations

import functools

import torch

from llmctl.engine.kernels.cpu import paged_attention_cpu

_MAX_HEAD_DIM = 256


def usable(layer, q: torch.Tensor) -> bool:
    """Whether the kernel can run `layer`'s first-chunk prefills for queries like `q`."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and layer.sinks is None
        and layer.head_dim % 32 == 0
        and layer.head_dim <= _MAX_HEAD_DIM
        and _ops() is not None
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    chunks: list[tuple[int, int]],
    scale: float,
) -> None:
    """Causal attention of each chunk's queries over its own keys, into `out`'s rows."""
    ops = _ops()
    if ops is None:
        raise RuntimeError("the CPU prefill attention kernel is not built: check usable() first")
    starts = [start for start, _ in chunks]
    lens = [length for _, length in chunks]
    ops.prefill_attention(q, k, v, out, starts, lens, scale)


@functools.cache
def _ops():
    name = paged_attention_cpu.namespace()
    if name is None:
        return None
    ops = getattr(torch.ops, name)
    return ops if ops.prefill_attention_available() else None
