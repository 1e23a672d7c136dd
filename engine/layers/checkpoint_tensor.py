"""CheckpointTensor: one tensor of a checkpoint, read lazily, as layer weight loaders receive it.

A tensor-parallel rank's `weight_loader` narrows it to its own slice (`narrow(dim, start, length)`)
before anything is read from disk, then `load()`s it. QuantizedCheckpointTensor is a GGUF file's
quantized tensor: raw blocks from the mapped file, narrowed the same way along whole blocks, then
decoded or repacked. Readers that make them live in model_loader/ (weights.py: safetensors and
pytorch_model.bin; gguf_file.py: GGUF); the layers only consume them.
"""

from __future__ import annotations

import mmap

from llmctl.engine.errors import ModelLoadError


class CheckpointTensor:
    """One tensor of a checkpoint; `narrow` reads only the requested rows or columns."""

    def __init__(self, name: str, shape: tuple[int, ...], reader, transposed: bool = False):
        self.name = name
        self._shape = tuple(shape)
        self._reader = reader  # reader(index_tuple) -> torch.Tensor for that slice
        self._transposed = transposed

    @classmethod
    def from_tensor(cls, name: str, tensor) -> CheckpointTensor:
        return cls(name, tuple(tensor.shape), lambda index: tensor[index])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self._shape)) if self._transposed else self._shape

    @property
    def T(self) -> CheckpointTensor:  # noqa: N802 - mirrors torch.Tensor.T
        if len(self._shape) != 2:
            raise ValueError(f"{self.name}: only 2-D tensors can be transposed")
        return CheckpointTensor(self.name, self._shape, self._reader, not self._transposed)

    def narrow(self, dim: int, start: int, length: int):
        dim = dim % len(self._shape)
        if self._transposed:
            dim = 1 - dim
        index = [slice(None)] * len(self._shape)
        index[dim] = slice(start, start + length)
        tensor = self._reader(tuple(index))
        return tensor.t() if self._transposed else tensor

    def load(self):
        tensor = self._reader(tuple(slice(None) for _ in self._shape))
        return tensor.t() if self._transposed else tensor


class QuantizedCheckpointTensor:
    """A quantized GGUF tensor of logical shape [N, K]: its raw blocks, never dequantized whole.

    `narrow` along dim 0 selects any rows; along dim 1 only whole blocks (a split inside one is a
    ConfigError). `decode()` gives the packed weight (kernels.PackedLinearWeight);
    `load()` the float32 weights (for a layer that keeps float weights).
    """

    def __init__(
        self,
        name: str,
        type_name: str,
        shape: tuple[int, int],
        blocks,  # numpy uint8 [N, bytes per row] (a view of the memory-mapped file)
        *,
        rows=None,  # numpy row indices (a permutation or a slice of them); None: all, in order
        columns: tuple[int, int] | None = None,  # [start, end) in weights, on block boundaries
        transposed: bool = False,
    ):
        import gguf

        self.name = name
        self.type_name = type_name
        self._full_shape = tuple(shape)
        self._blocks = blocks
        self._rows = rows
        self._columns = columns or (0, shape[1])
        self._transposed = transposed
        qtype = gguf.GGMLQuantizationType[type_name]
        self.block_size, self.type_size = gguf.GGML_QUANT_SIZES[qtype]

    def _replace(self, **changes) -> QuantizedCheckpointTensor:
        kw = dict(rows=self._rows, columns=self._columns, transposed=self._transposed)
        kw.update(changes)
        return QuantizedCheckpointTensor(
            self.name, self.type_name, self._full_shape, self._blocks, **kw
        )

    @property
    def shape(self) -> tuple[int, int]:
        n = self._full_shape[0] if self._rows is None else len(self._rows)
        shape = (n, self._columns[1] - self._columns[0])
        return shape[::-1] if self._transposed else shape

    @property
    def T(self) -> QuantizedCheckpointTensor:  # noqa: N802 - mirrors torch.Tensor.T
        # Only to undo a model's transposition (GPT-2's Conv1D): blocks run along K.
        return self._replace(transposed=not self._transposed)

    def _check_layout(self) -> None:
        if self._transposed:
            raise ModelLoadError(
                f"{self.name}: a quantized {self.type_name} tensor cannot be read transposed",
                "load this model from a float checkpoint",
            )

    def narrow(self, dim: int, start: int, length: int) -> QuantizedCheckpointTensor:
        import numpy as np

        self._check_layout()
        dim = dim % 2
        if dim == 0:
            rows = self._rows if self._rows is not None else np.arange(self._full_shape[0])
            return self._replace(rows=rows[start : start + length])
        first = self._columns[0] + start
        if start % self.block_size or length % self.block_size or start + length > self.shape[1]:
            from llmctl.engine.errors import ConfigError

            raise ConfigError(
                f"{self.name}: columns [{start}, {start + length}) do not fall on the "
                f"{self.block_size}-weight blocks of its {self.type_name} quantization",
                "use a tensor_parallel_size that splits the layer into whole blocks",
            )
        return self._replace(columns=(first, first + length))

    def raw(self):
        """numpy uint8 [rows, bytes]: the selected rows' blocks of the selected columns."""
        import numpy as np

        self._check_layout()
        blocks = self._blocks
        if self._columns != (0, self._full_shape[1]):
            start = self._columns[0] // self.block_size * self.type_size
            end = self._columns[1] // self.block_size * self.type_size
            blocks = blocks[:, start:end]
        if self._rows is not None:
            blocks = blocks[self._rows]
        return np.ascontiguousarray(blocks)

    def decode(self):
        """The selected part as a kernels.PackedLinearWeight (Q4_0/Q4_1 bytes copied as they
        are, no [N, K] intermediate). A type without a kernel raises ModelLoadError naming the
        supported ones."""
        import gguf

        from llmctl.engine.layers.quantization.gguf_quants import pack_gguf

        n, k = self.shape
        qtype = int(gguf.GGMLQuantizationType[self.type_name])
        return pack_gguf(self.raw(), qtype, n, k, self.name, release=drop_mapped_pages)

    def load(self):
        """float32 [rows, columns] torch tensor of the selected part."""
        import gguf
        import numpy as np
        import torch

        w = gguf.quants.dequantize(self.raw(), gguf.GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(w.reshape(self.shape), dtype=np.float32))


def drop_mapped_pages(data) -> None:
    """Take a tensor's pages of the mapped file out of this process's resident set, once its
    layer holds its own copy: the whole file would otherwise count towards the peak RSS (a later
    read, if any, faults them in again from the page cache)."""
    base = data
    while base is not None and not isinstance(base, mmap.mmap):
        # numpy views -> the frombuffer array -> its memoryview -> the mmap
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = data.__array_interface__["data"][0] - base_address(base)
    first = start - start % mmap.PAGESIZE
    end = start + data.nbytes
    last = end - end % mmap.PAGESIZE  # the pages wholly inside the tensor
    if last > first:
        base.madvise(mmap.MADV_DONTNEED, first, last - first)


def base_address(mapped: mmap.mmap) -> int:
    import numpy as np

    return np.frombuffer(mapped, dtype=np.uint8).__array_interface__["data"][0]
