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

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.checkpoint_tensor import (
    CheckpointTensor,
    drop_mapped_pages,
)


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
            return _owned_copy(torch.from_numpy(raw).view(dtype).reshape(shape)[index])

        yield name, CheckpointTensor(name, shape, reader, dtype=dtype)
        drop_mapped_pages(raw)  # the consumer holds its copy (a later read faults them back in)


_OWN_MAPPING_BYTES = 1 << 20


def _owned_copy(view):
    """The caller's own copy of `view`. From 1 MiB, in an anonymous mapping of its own, so
    freeing it gives the pages back at once: a weight loader copies each tensor into its parameter
    and drops the read, and glibc's heap kept such freed reads resident and often unused (torch
    allocates with posix_memalign, which asks glibc for the size plus the alignment: a freed
    chunk of one read's size does not serve the next), 0-45 MiB over the weights at the loading
    peak depending on where the heap began."""
    import mmap

    import numpy as np
    import torch

    nbytes = view.numel() * view.element_size()
    if nbytes < _OWN_MAPPING_BYTES:
        return view.clone()
    pages = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    return torch.from_numpy(pages).view(view.dtype).reshape(view.shape).copy_(view)


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
