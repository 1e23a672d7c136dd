"""Fp8CheckpointTensor: a block-FP8 weight as a checkpoint ships it, `X.weight` in float8_e4m3fn
with `X.weight_scale_inv`, one float32 per weight_block_size block (partial at the edges),
W = fp8 * scale_inv; the loader pairs the two (model_loader/fp8_checkpoint.py).

Layers narrow it like any checkpoint tensor; a quantized layer `decode()`s its slice into the
Fp8LinearWeight it holds (only its rows and columns and their scales are read: never the model in
float), a float layer (MLA's kv_b_proj) `load()`s the slice dequantized. The packed path needs the
slice on block boundaries (the engine refuses a tensor-parallel size that cuts a block before
loading, quantization/fp8.check_block_split); the float path takes any slice.
"""

from __future__ import annotations

import torch

from llmctl.engine.errors import ConfigError, ModelLoadError
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor


class Fp8CheckpointTensor:
    def __init__(
        self,
        name: str,
        weight: CheckpointTensor,
        scale_inv: CheckpointTensor,
        block: tuple[int, int],
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ):
        self.name, self.weight, self.scale_inv, self.block = name, weight, scale_inv, block
        n, k = weight.shape
        self.rows, self.cols = rows or (0, n), cols or (0, k)
        expected = (-(-n // block[0]), -(-k // block[1]))
        if tuple(scale_inv.shape) != expected:
            raise ModelLoadError(
                f"{name}: {tuple(scale_inv.shape)} block scales for a [{n}, {k}] FP8 weight; "
                f"blocks of {block[0]}x{block[1]} need {expected}",
                "the checkpoint's weight_block_size does not match its scales",
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])

    def narrow(self, dim: int, start: int, length: int) -> Fp8CheckpointTensor:
        dim = dim % 2
        span = self.rows if dim == 0 else self.cols
        if start < 0 or start + length > span[1] - span[0]:
            raise ModelLoadError(f"{self.name}: narrow({dim}, {start}, {length}) out of range")
        new = (span[0] + start, span[0] + start + length)
        rows, cols = (new, self.cols) if dim == 0 else (self.rows, new)
        return Fp8CheckpointTensor(self.name, self.weight, self.scale_inv, self.block, rows, cols)

    def _read(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(FP8 rows and columns, the block scales covering them, the first row's block row)."""
        (r0, r1), (c0, c1) = self.rows, self.cols
        bn, bk = self.block
        q = self.weight.read((slice(r0, r1), slice(c0, c1)))
        scales = self.scale_inv.read((slice(r0 // bn, -(-r1 // bn)), slice(c0 // bk, -(-c1 // bk))))
        return q, scales.to(torch.float32), r0

    def decode(self):
        """This slice as the Fp8LinearWeight a quantized layer holds."""
        from llmctl.engine.layers.quantization.fp8 import packed_weight

        bn, bk = self.block
        (r0, r1), (c0, c1) = self.rows, self.cols
        full_n, full_k = self.weight.shape
        for start, end, full, size, what in (
            (r0, r1, full_n, bn, "rows"),
            (c0, c1, full_k, bk, "columns"),
        ):
            if start % size or (end % size and end != full):
                raise ConfigError(
                    f"{self.name}: {what} [{start}, {end}) cut its {bn}x{bk} FP8 blocks",
                    "use a tensor_parallel_size that splits the layer into whole blocks",
                )
        q, scales, first = self._read()
        return packed_weight(q, scales, first, self.block)

    def load(self) -> torch.Tensor:
        """This slice dequantized to float32 (a layer that holds float weights)."""
        q, scales, _ = self._read()
        (r0, r1), (c0, c1) = self.rows, self.cols
        bn, bk = self.block
        row_block = torch.arange(r0, r1) // bn - r0 // bn
        col_block = torch.arange(c0, c1) // bk - c0 // bk
        return q.to(torch.float32) * scales[row_block][:, col_block]
