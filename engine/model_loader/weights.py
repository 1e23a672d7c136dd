"""Checkpoint tensors read lazily: a tensor-parallel rank reads only its own slice from disk.

`iterate_weights(directory)` yields (name, CheckpointTensor) for every tensor of a Hugging Face
checkpoint: safetensors (one file or sharded with model.safetensors.index.json) or
pytorch_model.bin (loaded with weights_only=True). Layer weight loaders call `narrow(...)` or
`load()` on them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

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
    from safetensors import safe_open

    total = 0
    for file in files:
        with _open_safetensors(file, safe_open) as f:
            total += len(f.keys())
    return total


def _open_safetensors(file: Path, safe_open):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises SafetensorError for truncated/corrupt files
        raise ModelLoadError(
            f"cannot read {file}: {exc}", "the file is corrupt or truncated; copy it again"
        ) from exc


def _iterate_safetensors(file: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    from safetensors import safe_open

    with _open_safetensors(file, safe_open) as f:
        for name in f.keys():
            handle = f.get_slice(name)
            shape = tuple(handle.get_shape())

            def reader(index, handle=handle, name=name):
                try:
                    return handle[index]
                except Exception as exc:
                    raise ModelLoadError(
                        f"cannot read tensor {name} from {file}: {exc}",
                        "the file is corrupt or truncated; copy it again",
                    ) from exc

            yield name, CheckpointTensor(name, shape, reader)


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
