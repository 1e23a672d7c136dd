"""TritonAttentionBackend: the cache write, paged decode and prefill attention as Triton kernels.

The kernels (kernels/triton/) are called through torch custom ops (kernels/triton/triton_ops.py),
so CUDA graphs capture them and device checks see them; the cache write skips padding slots (-1),
which is what lets CUDA graphs pad a batch. A decode-only step runs the paged decode kernel; a step
with a prefill chunk comes with all its sequences as chunks (decodes of one token: num_decodes 0)
and runs the varlen kernel once. A layer's sliding window and sinks go to the kernels.
"""

from __future__ import annotations

import torch

from llmctl.engine.attention.backends.base import AttentionBackend
from llmctl.engine.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    unified_mixed_steps = True  # the model runner sends mixed steps as chunks only

    def __init__(self) -> None:
        from llmctl.engine.kernels.triton import triton_ops

        self.ops = triton_ops

    def forward(self, layer, q, k, v, md: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = layer.kv_cache.unbind(0)
        ops = self.ops
        ops.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping)
        d = md.num_decodes
        parts = []
        if d:
            parts.append(
                ops.paged_decode_attention(
                    q[:d],
                    key_cache,
                    value_cache,
                    md.decode_block_tables,
                    md.decode_seq_lens,
                    layer.scale,
                    layer.sliding_window,
                    layer.sinks,
                )
            )
        if md.prefills:
            parts.append(
                ops.prefill_attention(
                    q[d:],
                    key_cache,
                    value_cache,
                    md.prefill_block_tables,
                    md.prefill_query_start_loc,
                    md.prefill_seq_lens,
                    md.prefill_context_lens,
                    md.max_prefill_query_len,
                    layer.scale,
                    layer.sliding_window,
                    layer.sinks,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
