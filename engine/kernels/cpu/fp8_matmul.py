"""Fp8LinearWeight: a block-FP8 weight and its matmul, y = x W^T, W never whole in float.

    W[n, k] = float8_e4m3fn(qweight[n, k]) * scales[n, k // group_size]

qweight: uint8 [N, K], the bits of the checkpoint's float8_e4m3fn values (one byte a weight);
scales: float32 [N, ceil(K / group_size)], each row's copy of the weight_scale_inv of the
128 x 128 block it lies in (group_size: the block's K side); the last group of a row may be
partial. Rows carry their own scales so that any whole-block slice of a checkpoint tensor, and
the sub-matrices of a fused layer (q, k, v; gate, up) stacked at any row, keep theirs: 1 + 4 / 128
bytes a weight.

The same packed-weight contract as quantized_matmul.PackedLinearWeight (linear_method.py and
moe_method.py hold either), with its own kernels:
- CPU (fp8_matmul_cpu.cpp, compiled on first use like the other CPU kernels): up to SMALL_BATCH
  rows of x, each weight byte read once for all of them and decoded in registers (weight-only:
  activations and accumulation stay float32); larger M, tiles of W expanded to float32 for
  torch's GEMM. Without a compiler, the same math in torch (dequantized tiles, F.linear).
- CUDA: the Triton block-FP8 GEMM (kernels/triton/triton_fp8_gemm.py): activations quantized to
  FP8 per token and group of group_size, FP8 tensor cores (compute capability 8.9 or newer).
Decoding gives the product fp8 * scale rounded once to float32: the weights a reference
dequantizing the checkpoint holds, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

logger = logging.getLogger("llmctl")

_SOURCE = Path(__file__).with_name("fp8_matmul_cpu.cpp")
_PREFIX = "llmctl_fp8_matmul"
SMALL_BATCH = 24  # rows of x up to which the decode kernel runs (as the quantized matmul's)
_TILE_BYTES = 1 << 20  # float32 bytes of W expanded per tile on the batched path


@dataclass(eq=False)
class Fp8LinearWeight:
    out_features: int  # N
    in_features: int  # K
    group_size: int  # the K side of a scale's block
    qweight: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # float32 [N, ceil(K / group_size)]
    bits: ClassVar[int] = 8
    zeros: ClassVar[None] = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] float -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x.is_cpu:
            from llmctl.engine.kernels.triton import triton_ops  # noqa: F401  (llmctl::*)

            y = torch.ops.llmctl.fp8_block_mm(x2, self.qweight, self.scales, self.group_size)
            return y.reshape(*lead, self.out_features)
        x2 = x2.to(torch.float32).contiguous()
        op = _kernel()
        if op is not None and x2.shape[0] <= SMALL_BATCH:
            y = op.fp8_group_mm(x2, self.qweight, self.scales, self.group_size)
        elif op is not None:
            rows = max(8, min(max(16, _TILE_BYTES // (4 * self.in_features)), self.out_features))
            y = op.fp8_tiled_mm(x2, self.qweight, self.scales, self.group_size, rows)
        else:
            y = F.linear(x2, self.dequantize())
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) of W in float32."""
        end = self.out_features if end is None else end
        op = _kernel() if self.qweight.is_cpu else None
        if op is not None:
            return op.fp8_dequantize_rows(self.qweight, self.scales, self.group_size, start, end)
        return dequantize_fp8(self.qweight[start:end], self.scales[start:end], self.group_size)

    def to(self, device: torch.device | str) -> Fp8LinearWeight:
        if self.qweight.device == torch.device(device):
            return self
        return dataclasses.replace(
            self, qweight=self.qweight.to(device), scales=self.scales.to(device)
        )

    @classmethod
    def cat(cls, parts: list[Fp8LinearWeight]) -> Fp8LinearWeight:
        """The rows of `parts` (one K, one group size) stacked: a fused layer's weight."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if any(
            (p.in_features, p.group_size) != (first.in_features, first.group_size) for p in parts
        ):
            raise ValueError("FP8 parts differ in in_features or group size")
        return cls(
            sum(p.out_features for p in parts),
            first.in_features,
            first.group_size,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
        )

    @property
    def nbytes(self) -> int:
        """Bytes held: one a weight, plus the rows' float32 scales."""
        return self.qweight.numel() + 4 * self.scales.numel()


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 W of uint8 FP8 bits [N, K] and row scales [N, ceil(K / group_size)] (torch)."""
    k = qweight.shape[1]
    w = qweight.view(torch.float8_e4m3fn).to(torch.float32)
    return w * scales.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]


def kernel_available() -> bool:
    """True when the C++ kernel is built and loaded (building it now if needed)."""
    return _kernel() is not None


@functools.cache
def _kernel() -> Any | None:
    from llmctl.engine.kernels.cpu.cpu_extension import compile_extension, first_error_line

    try:
        name = compile_extension(_SOURCE, _PREFIX, "CPU FP8 matmul kernel", "native", ())
        return getattr(torch.ops, name)
    except Exception as e:  # no compiler: dequantized tiles for torch's matmul, one warning
        logger.warning(
            "CPU FP8 matmul kernel unavailable, dequantizing for torch's matmul instead "
            "(slower): %s",
            first_error_line(e),
        )
        return None
