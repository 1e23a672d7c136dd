"""TritonMLABackend: the latent cache write and the absorbed decode as Triton kernels
(kernels/triton/triton_mla.py, through torch custom ops so CUDA graphs capture them; the write
skips padding slots). Prefill chunks take the torch backend's expanded path (kv_b_proj expands
the chunk's keys and values, SDPA attends), as vLLM's MLA expands them for prefill."""

from __future__ import annotations

import torch

from llmctl.engine.attention.backends.mla_torch import TorchMLABackend
from llmctl.engine.attention.metadata import AttentionMetadata


class TritonMLABackend(TorchMLABackend):
    name = "triton-mla"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from llmctl.engine.kernels.triton import triton_ops

        self.ops = triton_ops

    def write(self, cache, latent, k_pe, slot_mapping) -> None:
        self.ops.mla_write_cache(latent.contiguous(), k_pe.contiguous(), cache, slot_mapping)

    def decode(self, layer, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)
        o_latent = self.ops.mla_decode_attention(
            layer.absorb_query(q_nope).contiguous(),
            q_pe.contiguous(),
            layer.kv_cache,
            md.decode_block_tables,
            md.decode_seq_lens,
            layer.scale,
        )
        return layer.expand_output(o_latent)
