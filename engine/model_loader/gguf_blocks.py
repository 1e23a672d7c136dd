"""GGUF block formats -> the packed form's parts (q, scales, zeros, bits, group_size).

PRIVATE STOP-GAP until engine/layers/quantization/gguf_quants.py lands: Q4_0, Q4_1 and Q8_0 only
(the bundled model's types); other types return None and their layer keeps float weights.
"""

from __future__ import annotations


def decode_blocks(raw, type_name: str, k: int):
    """raw: numpy uint8 [N, K / block * block bytes] -> (q, scales, zeros, bits, group_size) with
    W[n, j] = q[n, j] * scales[n, j // g] + zeros[n, j // g] (zeros None: symmetric)."""
    try:
        from llmctl.engine.layers.quantization import gguf_quants
    except ImportError:
        gguf_quants = None
    if gguf_quants is not None:
        return gguf_quants.decode_gguf(raw, type_name, k)
    import numpy as np
    import torch

    n = raw.shape[0]
    if type_name not in ("Q4_0", "Q4_1", "Q8_0"):
        return None
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    blocks = raw.reshape(n, k // 32, block_bytes)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return torch.from_numpy(q), torch.from_numpy(d), None, 8, 32
    offset = 2 if type_name == "Q4_0" else 4
    qs = blocks[..., offset:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    if type_name == "Q4_0":
        zeros = d * -8.0
    else:
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros), 4, 32
