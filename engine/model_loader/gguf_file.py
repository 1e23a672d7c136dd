"""A GGUF file's tensors, memory-mapped and read in place: no converted copy on disk.

`read_gguf_tensors(path)` parses only the header (skipping the metadata values, the tokenizer's
vocabulary included, without decoding them: milliseconds where gguf.GGUFReader takes seconds) and
returns each tensor's name, type, shape and a numpy view of its bytes in one shared memory map.
`iterate_gguf_weights` yields them under Hugging Face names: float tensors as CheckpointTensor,
quantized ones as QuantizedCheckpointTensor (raw blocks, narrowed per rank before decoding), or,
with `dequantize=True`, every tensor as float32 (the float reference path).

Layout (little-endian): "GGUF" u32 version u64 n_tensors u64 n_kv; n_kv x (key: string, u32 type,
value); n_tensors x (name: string, u32 n_dims, n_dims x u64 dims (innermost first), u32 type,
u64 offset); padding to general.alignment (default 32); tensor data. A string is u64 length +
bytes; an array is u32 element type + u64 count + elements.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.checkpoint_tensor import drop_mapped_pages

# Fixed-size GGUF value types: type id -> struct format.
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_ARRAY_VALUES = 1024  # longer arrays are read as their length (the vocabulary: 49152 strings)


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType name: F32, Q4_1, ...
    shape: tuple[int, ...]  # PyTorch order: [rows, columns] for a matrix
    data: object  # numpy view: [rows, bytes per row] uint8 for quantized types, else float


def _open(path: str | Path, arrays: Collection[str] = ()):
    import numpy as np

    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = np.frombuffer(mapped, dtype=np.uint8)
        return (buf, *_parse_header(memoryview(buf), arrays))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({exc})",
            "check that the download finished, or name another model",
        ) from exc


def gguf_architecture(path: str | Path) -> str:
    """general.architecture: llama, gpt2, ..."""
    return _open(path)[3].get("general.architecture", "")


def read_gguf_tensors(path: str | Path) -> list[GGUFTensorInfo]:
    import gguf
    import numpy as np

    buf, infos, data_start, _ = _open(path)
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            qtype = None
        shape = tuple(reversed(dims))
        if qtype is None or qtype not in gguf.GGML_QUANT_SIZES:
            type_name = qtype.name if qtype is not None else f"type {type_id}"
            tensors.append(GGUFTensorInfo(name, type_name, shape, None))
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        count = 1
        for d in dims:
            count *= d
        nbytes = count // block * type_size
        raw = buf[data_start + offset : data_start + offset + nbytes]
        if qtype.name in ("F32", "F16"):
            data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(shape)
        else:
            rows = count // dims[0]
            data = raw.reshape(rows, dims[0] // block * type_size)
        tensors.append(GGUFTensorInfo(name, qtype.name, shape, data))
    return tensors


def _parse_header(
    mv: memoryview, arrays: Collection[str] = ()
) -> tuple[list[tuple[str, list[int], int, int]], int, dict]:
    """(tensor infos (name, dims, type, offset), data start, the metadata: scalars and strings
    by value, arrays of up to _ARRAY_VALUES scalars as lists, longer arrays (the tokenizer's
    vocabulary) by their length, except the keys in `arrays`, read whole as lists (a string
    array of 49152 tokens decodes in ~25 ms))."""
    if bytes(mv[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    pos = 24
    alignment = 32
    metadata: dict[str, object] = {}
    length = struct.Struct("<Q").unpack_from

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", mv, pos)
        return bytes(mv[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n

    def strings(pos: int, count: int) -> list[str]:
        values = []
        for _ in range(count):
            (n,) = length(mv, pos)
            values.append(bytes(mv[pos + 8 : pos + 8 + n]).decode("utf-8"))
            pos += 8 + n
        return values

    def skip(type_id: int, pos: int) -> int:
        if type_id in _SCALARS:
            return pos + struct.calcsize(_SCALARS[type_id])
        if type_id == _STRING:
            (n,) = struct.unpack_from("<Q", mv, pos)
            return pos + 8 + n
        if type_id == _ARRAY:
            item, count = struct.unpack_from("<IQ", mv, pos)
            pos += 12
            if item in _SCALARS:
                return pos + count * struct.calcsize(_SCALARS[item])
            for _ in range(count):
                pos = skip(item, pos)
            return pos
        raise ValueError(f"unknown metadata value type {type_id}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (type_id,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        if type_id in _SCALARS:
            (metadata[key],) = struct.unpack_from("<" + _SCALARS[type_id], mv, pos)
        elif type_id == _STRING:
            metadata[key] = string(pos)[0]
        elif type_id == _ARRAY:
            item, count = struct.unpack_from("<IQ", mv, pos)
            if key in arrays and item == _STRING:
                metadata[key] = strings(pos + 12, count)
            elif item in _SCALARS and (count <= _ARRAY_VALUES or key in arrays):
                fmt = f"<{count}{_SCALARS[item]}"
                metadata[key] = list(struct.unpack_from(fmt, mv, pos + 12))
            else:
                metadata[key] = count
        if key == "general.alignment" and type_id in _SCALARS:
            alignment = int(metadata[key])
        pos = skip(type_id, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", mv, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", mv, pos + 4))
        pos += 4 + 8 * n_dims
        type_id, offset = struct.unpack_from("<IQ", mv, pos)
        pos += 12
        infos.append((name, dims, type_id, offset))
    return infos, -(-pos // alignment) * alignment, metadata


def read_gguf_metadata(
    path: str | Path, arrays: Collection[str] = ()
) -> tuple[dict, list[tuple[str, str]]]:
    """The metadata (see _parse_header; the keys in `arrays` read whole) and each tensor's
    (name, GGML type name), from the header alone: what planning needs, in milliseconds."""
    import gguf

    _, infos, _, metadata = _open(path, arrays)
    types = []
    for name, _, type_id, _ in infos:
        try:
            types.append((name, gguf.GGMLQuantizationType(type_id).name))
        except ValueError:
            types.append((name, f"type {type_id}"))
    return metadata, types


def gguf_tensor_count(path: str | Path) -> int:
    """How many tensors iterate_gguf_weights yields at most: a stacked expert tensor is one
    per expert (its outermost dimension)."""
    from llmctl.engine.model_loader.gguf_moe import is_stacked_experts

    return sum(dims[-1] if is_stacked_experts(name) else 1 for name, dims, _, _ in _open(path)[1])


def gguf_tensor_types(path: str | Path) -> list[str]:
    """The type of every tensor in the file (F32, Q4_1, ...)."""
    return [t.type_name for t in read_gguf_tensors(path)]


def iterate_gguf_weights(
    path: str | Path, arch: str, num_heads: int, num_kv_heads: int, *, dequantize: bool = False
) -> Iterator[tuple[str, object]]:
    """(Hugging Face name, CheckpointTensor | QuantizedCheckpointTensor) for each tensor."""
    from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor, QuantizedCheckpointTensor
    from llmctl.engine.layers.quantization.quant_config import QuantizationConfig
    from llmctl.engine.model_loader.gguf import _GPT2_CONV1D, _PERMUTED_QK, _hf_name
    from llmctl.engine.model_loader.gguf_moe import (
        EXPERT,
        is_vector_shared_expert_gate,
        moe_tensors,
    )

    tensors = read_gguf_tensors(path)
    QuantizationConfig.for_gguf([t.type_name for t in tensors])  # refuses unsupported types
    for t in tensors:
        hf_name = _hf_name(arch, t.name)
        if hf_name is None:
            continue
        if EXPERT in hf_name or is_vector_shared_expert_gate(t):  # gguf_moe.py
            yield from moe_tensors(hf_name, t, lambda t: _float_reader(t, None), dequantize)
            continue
        rows = None
        if arch in _PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = num_heads if "attn_q" in t.name else num_kv_heads
            rows = _unpermuted_row_order(t.shape[0], heads)
        conv1d = arch == "gpt2" and t.name.endswith(_GPT2_CONV1D)
        if t.type_name in ("F32", "F16", "BF16") or dequantize:
            # GPT-2's Conv1D is [in, out] in Hugging Face checkpoints, which its model transposes
            # on loading; GGUF stores [out, in]: present the transposed view.
            yield hf_name, CheckpointTensor(hf_name, t.shape, _float_reader(t, rows), conv1d)
            continue
        tensor = QuantizedCheckpointTensor(hf_name, t.type_name, t.shape, t.data, rows=rows)
        # GPT-2's model transposes Conv1D weights on loading; GGUF already stores [out, in].
        yield hf_name, (tensor.T if conv1d else tensor)
        drop_mapped_pages(t.data)  # the layer has packed its copy


def _float_reader(t: GGUFTensorInfo, rows):
    """index -> float32 torch tensor of that slice (the tensor is dequantized on first read)."""
    import numpy as np
    import torch

    cache: dict = {}

    def read(index):
        if "w" not in cache:
            if t.type_name in ("F32", "F16"):
                w = np.asarray(t.data, dtype=np.float32)
            else:
                import gguf

                w = gguf.quants.dequantize(
                    np.asarray(t.data), gguf.GGMLQuantizationType[t.type_name]
                ).reshape(t.shape)
            if rows is not None:
                w = w[rows]
            cache["w"] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
        return cache["w"][index]

    return read


def _unpermuted_row_order(num_rows: int, num_heads: int):
    """Row order undoing llama.cpp's interleaving of the rotary halves in each head (see
    gguf._unpermute_rotary_rows): whole rows, so it applies to quantized blocks as well."""
    import numpy as np

    from llmctl.engine.model_loader.gguf import _unpermute_rotary_rows

    return _unpermute_rotary_rows(np.arange(num_rows), num_heads)
