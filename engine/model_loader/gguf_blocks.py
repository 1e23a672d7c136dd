"""GGUF block formats -> the packed form's parts (q, scales, zeros, bits, group_size), through
engine/layers/quantization/gguf_quants.py."""

from __future__ import annotations


def decode_blocks(raw, type_name: str, k: int):
    """raw: numpy uint8 [N, K / block * block bytes] -> (q, scales, zeros, bits, group_size),
    torch tensors: W[n, j] = q[n, j] * scales[n, j // g] + zeros[n, j // g] (zeros None: none)."""
    import gguf
    import torch

    from llmctl.engine.layers.quantization.gguf_quants import unpack_blocks

    g = unpack_blocks(raw, int(gguf.GGMLQuantizationType[type_name]), raw.shape[0], k)
    zeros = None if g.zeros is None else torch.from_numpy(g.zeros)
    return torch.from_numpy(g.q), torch.from_numpy(g.scales), zeros, g.bits, g.group_size
