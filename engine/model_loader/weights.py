"""Checkpoint tensors read lazily: a tensor-parallel rank reads only its own slice from disk.

`iterate_weights(directory)` yields (name, CheckpointTensor) for every tensor of a Hugging Face
checkpoint: safetensors (one file or sharded with model.safetensors.index.json) or
pytorch_model.bin (loaded with weights_only=True). Layer weight loaders call `narrow(...)` or
`load()` on them. A GGUF file's quantized tensors are QuantizedCheckpointTensor (raw blocks,
model_loader/gguf_file.py), narrowed the same way before they are decoded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from llmctl.engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch


class CheckpointTensor:
    """One tensor of a checkpoint; `narrow` reads only the requested rows or columns."""

    def __init__(
        self, name: str, shape: tuple[int, ...], reader, transposed: bool = False, dtype=None
    ):
        self.name = name
        self._shape = tuple(shape)
        self._reader = reader  # reader(index_tuple) -> torch.Tensor for that slice
        self._transposed = transposed
        self.dtype = dtype  # the stored torch dtype (float8_e4m3fn: a block-FP8 weight)

    @classmethod
    def from_tensor(cls, name: str, tensor) -> CheckpointTensor:
        return cls(name, tuple(tensor.shape), lambda index: tensor[index], dtype=tensor.dtype)

    def read(self, index: tuple) -> torch.Tensor:
        """The stored tensor at `index` (a tuple of slices), reading only that part."""
        return self._reader(index)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self._shape)) if self._transposed else self._shape

    @property
    def T(self) -> CheckpointTensor:  # noqa: N802 - mirrors torch.Tensor.T
        if len(self._shape) != 2:
            raise ValueError(f"{self.name}: only 2-D tensors can be transposed")
        return CheckpointTensor(
            self.name, self._shape, self._reader, not self._transposed, self.dtype
        )

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
        from llmctl.engine.model_loader.gguf_file import drop_mapped_pages

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


def weight_files(directory: str | os.PathLike) -> tuple[str, list[Path]]:
    """("safetensors" | "pt", files) for the checkpoint in `directory`."""
    path = Path(directory)
    for kind, single, index in (
        ("safetensors", "model.safetensors", "model.safetensors.index.json"),
        ("pt", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelLoadError(
                    f"{path / index} is not a valid checkpoint index ({exc})",
                    "re-download or re-save the model",
                ) from exc
            files = [path / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(
                    f"{path / index} names missing shards: {', '.join(missing)}",
                    "copy every shard the index lists next to it",
                )
            return kind, files
        if (path / single).is_file():
            return kind, [path / single]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return "safetensors", files
    raise ModelLoadError(
        f"no weights in {path}", "expected model.safetensors(.index.json) or pytorch_model.bin"
    )


def iterate_weights(directory: str | os.PathLike) -> Iterator[tuple[str, CheckpointTensor]]:
    kind, files = weight_files(directory)
    for file in files:
        if kind == "safetensors":
            yield from _iterate_safetensors(file)
        else:
            yield from _iterate_pt(file)


def count_weights(directory: str | os.PathLike) -> int:
    kind, files = weight_files(directory)
    if kind != "safetensors":
        return 0
    total = 0
    for file in files:
        with open(file, "rb") as f:
            header = _read_safetensors_header(file, f)[0]
        total += sum(name != "__metadata__" for name in header)
    return total


def _corrupt(file: Path, detail: str) -> ModelLoadError:
    return ModelLoadError(
        f"cannot read {file}: {detail}", "the file is corrupt or truncated; copy it again"
    )


def _read_safetensors_header(file: Path, f) -> tuple[dict, int, int]:
    """(header, data_start, file size) of the safetensors file `file`, open as `f` at offset 0.
    Raises ModelLoadError for a short file or a broken header."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _corrupt(file, f"{size} bytes, shorter than a safetensors header")
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > size - 8:
        raise _corrupt(file, f"the header claims {header_len} bytes of {size - 8}")
    try:
        header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(file, f"its header is not JSON ({exc})") from exc
    return header, 8 + header_len, size


# safetensors' dtype names -> torch dtype names
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def _iterate_safetensors(file: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """The file's tensors, read from one private memory map of it: a reader copies out the slice
    asked for, and once the consumer moves on to the next tensor this one's pages leave the
    resident set (safetensors' own reader keeps every page it touched mapped until the file is
    closed: the whole checkpoint on top of the model's weights at the loading peak)."""
    import mmap

    import numpy as np
    import torch

    from llmctl.engine.model_loader.gguf_file import drop_mapped_pages

    with open(file, "rb") as f:
        header, data_start, size = _read_safetensors_header(file, f)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable: no torch warning
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = getattr(torch, _SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _corrupt(file, f"tensor {name}: bad header entry {info!r}") from exc
        if end - begin != dtype.itemsize * int(np.prod(shape)) or data_start + end > size:
            raise _corrupt(file, f"tensor {name} lies outside the file or has the wrong size")
        raw = np.frombuffer(mapped, dtype=np.uint8, count=end - begin, offset=data_start + begin)

        def reader(index, raw=raw, dtype=dtype, shape=shape):
            return torch.from_numpy(raw).view(dtype).reshape(shape)[index].clone()

        yield name, CheckpointTensor(name, shape, reader, dtype=dtype)
        drop_mapped_pages(raw)  # the consumer holds its copy (a later read faults them back in)


def _iterate_pt(file: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    import pickle

    import torch

    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot read {file}: {exc}",
            "the file is corrupt, truncated, or holds more than tensors (weights_only=True)",
        ) from exc
    for name, tensor in state.items():
        yield name, CheckpointTensor.from_tensor(name, tensor)
