"""CPUAttentionBackend: the torch backend, with decodes in the C++ paged decode kernel.

The kernel (kernels/cpu/paged_attention_cpu.cpp) reads each K and V row once, for all the query
heads that share it, straight from the paged cache; where it is not built, or cannot take the
shape, the torch backend's gather + SDPA runs instead (kernels/cpu/paged_attention_cpu.py decides
per call). The fused decode stack (kernels/cpu/fused_decode.py) calls the same kernel.
"""

from __future__ import annotations

from llmctl.engine.attention.backends.torch_sdpa import TorchSDPABackend
from llmctl.engine.kernels.cpu.paged_attention_cpu import paged_decode_attention


class CPUAttentionBackend(TorchSDPABackend):
    name = "cpu"
    runs_cpu_decode_kernel = True

    def decode(self, q, key_cache, value_cache, block_tables, seq_lens, scale, window):
        return paged_decode_attention(
            q, key_cache, value_cache, block_tables, seq_lens, scale, window
        )
