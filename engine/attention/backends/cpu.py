"""CPUAttentionBackend: the torch backend, with decodes in the C++ paged decode kernel and
prefill chunks (bfloat16 or float32) in the C++ prefill kernel.

The kernel (kernels/cpu/paged_attention_cpu.cpp) reads each K and V row once, for all the query
heads that share it, straight from the paged cache, with the layer's sliding window and sinks;
where it is not built, or cannot take the shape, the torch backend's gather + SDPA runs instead
(kernels/cpu/paged_attention_cpu.py decides per call). The fused decode stack
(kernels/cpu/fused_decode.py) calls the same kernel. A layer's prefill chunks go to
kernels/cpu/prefill_attention.py's kernel, all in one call, where `usable` (no sinks);
else to scaled_dot_product_attention one by one. The step's keys and values go into the cache
first, by the extension's row copy (paged_attention_cpu.write_kv_cache).
"""

from __future__ import annotations

from llmctl.engine.attention.backends.torch_sdpa import TorchSDPABackend
from llmctl.engine.kernels.cpu import prefill_attention
from llmctl.engine.kernels.cpu.paged_attention_cpu import paged_decode_attention, write_kv_cache


class CPUAttentionBackend(TorchSDPABackend):
    name = "cpu"
    runs_cpu_decode_kernel = True

    def decode(self, q, key_cache, value_cache, block_tables, seq_lens, scale, window, sinks):
        return paged_decode_attention(
            q, key_cache, value_cache, block_tables, seq_lens, scale, window, sinks
        )

    def write_cache(self, key_cache, value_cache, k, v, slot_mapping) -> None:
        if not write_kv_cache(key_cache, value_cache, k, v, slot_mapping):
            super().write_cache(key_cache, value_cache, k, v, slot_mapping)

    def prefill(self, layer, q, k, v, chunks, md, key_cache, value_cache, out) -> None:
        if not prefill_attention.usable(layer, q):
            super().prefill(layer, q, k, v, chunks, md, key_cache, value_cache, out)
            return
        prefill_attention.prefill_attention(
            q,
            key_cache,
            value_cache,
            out,
            md.prefill_block_tables,
            chunks,
            layer.scale,
            layer.sliding_window,
        )
