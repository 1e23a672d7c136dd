"""A packed, group-quantized weight and its matmul: y = x W^T with W never materialised in float.

The contract every format is converted to at load time (GGUF blocks, round-to-nearest int8/int4):

    W[n, k] = q[n, k] * scales[n, k // group_size] + zeros[n, k // group_size]

with q unsigned in [0, 15] for bits=4 and signed in [-128, 127] for bits=8 (zeros None: symmetric).
N is the output features (rows, split by column-parallel layers), K the input features (split by
row-parallel layers in whole groups).

SKELETON: `pack_groups` below keeps a dequantized float copy so that the loader and layers can be
built against the interface; the kernels replace it (int4: aten's int4pack matmul; int8 groups: a
C++ kernel), without changing the interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedLinearWeight:
    out_features: int  # N
    in_features: int  # K
    bits: int
    group_size: int
    _dequantized: torch.Tensor  # SKELETON ONLY: [N, K] float

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float -> [M, N] in x's dtype."""
        return x @ self._dequantized.to(x.dtype).T

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds in memory (packed data, scales and zeros)."""
        return self._dequantized.numel() * self._dequantized.element_size()


def pack_groups(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> PackedLinearWeight:
    """q: [N, K] integer (uint8 for 4 bits, int8 for 8 bits); scales, zeros: [N, K // group_size]
    float32. K must be a multiple of group_size."""
    n, k = q.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    s = scales.float().repeat_interleave(group_size, dim=1)
    w = q.float() * s
    if zeros is not None:
        w += zeros.float().repeat_interleave(group_size, dim=1)
    return PackedLinearWeight(n, k, bits, group_size, w)
