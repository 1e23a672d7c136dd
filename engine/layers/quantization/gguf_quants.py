"""GGUF quantized blocks -> the packed-weight contract of kernels/cpu/quantized_matmul.py, in
vectorised numpy.

    W[n, k] = q[n, k] * scales[n, k // group_size] + zeros[n, k // group_size]

A GGUF tensor with ne = [K, N] is N rows of K elements, each row stored as K / block_size blocks
of type_size bytes. `unpack_blocks` reads those bytes (an mmap'd view is fine; nothing is written)
and returns q, scales and zeros exactly (dequantizing them gives gguf.quants.dequantize's floats
bit for bit):

    type  block bytes              bits  group  q                 scale       zero
    Q4_0   32   18 (d, 16 nibbles)  4     32    nibble 0..15      d           -8 d
    Q4_1   32   20 (d, m, nibbles)  4     32    nibble 0..15      d           m
    Q8_0   32   34 (d, 32 int8)     8     32    int8              d           (none)
    Q4_K  256  144                  4     32    nibble 0..15      d sc[j]     -dmin m[j]
    Q6_K  256  210                  8     16    6-bit - 32        d sc[j]     (none)

(Q4_K: 8 sub-blocks of 32 with 6-bit scales sc and mins m; Q6_K: 16 sub-blocks of 16 with int8
scales.) Nibbles are returned one element per byte; kernels.pack_groups repacks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from llmctl.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from llmctl.engine.kernels.cpu.quantized_matmul import PackedLinearWeight

QK_K = 256


class GroupQuantized(NamedTuple):
    q: np.ndarray  # [N, K]: uint8 in [0, 15] for bits=4, int8 for bits=8
    scales: np.ndarray  # [N, K // group_size] float32
    zeros: np.ndarray | None  # [N, K // group_size] float32, None for bits=8
    bits: int
    group_size: int


# GGML type id -> (name, elements per block, bytes per block)
_FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    14: ("Q6_K", QK_K, 210),
}

# GGML type name -> elements per block (a row split must fall on whole blocks).
BLOCK_ELEMENTS = {name: block for name, block, _ in _FORMATS.values()}


def supported_types() -> list[str]:
    """Names of the GGUF quantized types that run natively."""
    return [name for name, _, _ in _FORMATS.values()]


def block_size(ggml_type: int) -> int:
    """Elements per block: a row split (tensor parallel) must fall on a multiple of this."""
    return _format(ggml_type, "tensor")[1]


# GGML type name -> (bits, group_size) of the packed weight it becomes in memory.
PACKED_FORMATS = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q8_0": (8, 32),
    "Q4_K": (4, 32),
    "Q6_K": (8, 16),
}
# Types whose scales (and zeros) are the file's own fp16 values, kept as float16 (exact, half the
# bytes); the K-quants' scales are products (d * a 6-bit scale), kept as float32.
FP16_SCALE_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def scale_bytes(type_name: str) -> int:
    """Bytes of one scale (or zero) of the packed weight a GGUF type becomes."""
    return 2 if type_name in FP16_SCALE_TYPES else 4


def packed_format(ggml_type: int) -> tuple[int, int]:
    """(bits, group_size) of the packed weight a GGUF type becomes (see the table above)."""
    return PACKED_FORMATS[_format(ggml_type, "tensor")[0]]


def packed_nbytes(n: int, k: int, bits: int, group_size: int, scale_bytes: int = 4) -> int:
    """Bytes a packed [n, k] weight holds in memory (PackedLinearWeight.nbytes), for planning:
    q at bits / 8 bytes a weight, scales, and zeros for 4 bits (`scale_bytes` each)."""
    groups = n * (k // group_size)
    return n * k * bits // 8 + scale_bytes * groups * (2 if bits == 4 else 1)


def unpack_blocks(
    raw: np.ndarray, ggml_type: int, n: int, k: int, name: str = "tensor"
) -> GroupQuantized:
    """raw: the tensor's bytes (any shape; N * K / block_size blocks) -> GroupQuantized.

    Raises ModelLoadError for a type that has no native kernel (naming the supported ones) or a
    byte count / row length that does not fit the format.
    """
    type_name, block, type_size = _format(ggml_type, name)
    if k % block:
        raise ModelLoadError(
            f"{name}: rows of {k} elements are not whole {type_name} blocks of {block}",
            "the GGUF file is corrupt or was written for a different shape",
        )
    blocks = np.asarray(raw).reshape(-1).view(np.uint8)
    if blocks.size != n * (k // block) * type_size:
        raise ModelLoadError(
            f"{name}: {blocks.size} bytes of {type_name} data, expected "
            f"{n * (k // block) * type_size} for [{n}, {k}]",
            "the GGUF file is truncated or corrupt; download it again",
        )
    blocks = blocks.reshape(-1, type_size)
    return _UNPACK[type_name](blocks, n, k)


def pack_gguf(
    raw: np.ndarray,
    ggml_type: int,
    n: int,
    k: int,
    name: str = "tensor",
    release: Callable[[np.ndarray], None] | None = None,
) -> PackedLinearWeight:
    """The packed weight the quantized layers hold: unpack_blocks, then kernels.pack_groups.

    Q4_0 and Q4_1 store their nibbles in the kernel's own order, so their bytes are copied as
    they are (no [N, K] intermediate), as are Q8_0's int8 values; these three keep their fp16
    scales as float16. They are copied a few rows at a time, and `release` (if given) is called
    with the rows of `raw` already copied: a memory-mapped file's pages can leave the resident
    set as they are read, not after the whole tensor.
    """
    import torch

    from llmctl.engine.kernels.cpu.quantized_matmul import PackedLinearWeight, pack_groups

    type_name, block, type_size = _format(ggml_type, name)
    blocks = np.asarray(raw).reshape(-1).view(np.uint8)
    if (
        type_name in ("Q4_0", "Q4_1", "Q8_0")
        and k % block == 0
        and blocks.size == n * (k // block) * type_size
    ):
        rows = blocks.reshape(n, k // block, type_size)
        groups = k // 32
        d = np.empty((n, groups), np.float16)
        m = np.empty((n, groups), np.float16) if type_name == "Q4_1" else None
        q = np.empty((n, k // 2 if type_name != "Q8_0" else k), np.uint8)
        head = type_size - (16 if type_name != "Q8_0" else 32)  # d (and m) before the values
        step = max(1, (1 << 20) // (rows.shape[1] * type_size))  # ~1 MiB of the file at a time
        for start in range(0, n, step):
            part = rows[start : start + step]
            d[start : start + step] = part[:, :, :2].copy().view(np.float16)[..., 0]
            if m is not None:
                m[start : start + step] = part[:, :, 2:4].copy().view(np.float16)[..., 0]
            q[start : start + step] = part[:, :, head:].reshape(part.shape[0], -1)
            if release is not None:
                release(part)
        scales = torch.from_numpy(d)
        if type_name == "Q8_0":
            return PackedLinearWeight(n, k, 8, 32, torch.from_numpy(q.view(np.int8)), scales, None)
        # Q4_0's zero, -8 d, is exact in float16 (a power-of-two multiple)
        zeros = torch.from_numpy(m) if m is not None else -8 * scales
        return PackedLinearWeight(n, k, 4, 32, torch.from_numpy(q), scales, zeros)
    g = unpack_blocks(raw, ggml_type, n, k, name)
    zeros = None if g.zeros is None else torch.from_numpy(g.zeros)
    return pack_groups(
        torch.from_numpy(g.q), torch.from_numpy(g.scales), zeros, g.bits, g.group_size
    )


def dequantize(g: GroupQuantized) -> np.ndarray:
    """The float32 [N, K] weight the contract defines (a reference; the kernels never build it)."""
    n, k = g.q.shape
    w = g.q.astype(np.float32).reshape(n, -1, g.group_size) * g.scales[:, :, None]
    if g.zeros is not None:
        w += g.zeros[:, :, None]
    return w.reshape(n, k)


def _format(ggml_type: int, name: str) -> tuple[str, int, int]:
    fmt = _FORMATS.get(int(ggml_type))
    if fmt is None:
        raise ModelLoadError(
            f"{name}: GGUF type {_type_name(ggml_type)} has no native kernel; supported "
            f"quantized types: {', '.join(supported_types())} (and F32, F16, BF16)",
            "use a GGUF file quantized as Q4_0, Q4_1, Q8_0, Q4_K_M or Q6_K, or a float checkpoint "
            "with --quantization int8 or int4",
        )
    return fmt


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return f"#{int(ggml_type)}"


def _f16(b: np.ndarray) -> np.ndarray:
    """[n_blocks, 2] bytes -> [n_blocks] float32."""
    return np.ascontiguousarray(b).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """[n_blocks, B] bytes where each `span` bytes hold `span` elements in the low nibbles and the
    next `span` in the high nibbles -> [n_blocks, 2 B] uint8."""
    n_blocks = qs.shape[0]
    qs = qs.reshape(n_blocks, -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n_blocks, -1)


def _q4_0(blocks: np.ndarray, n: int, k: int) -> GroupQuantized:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 16).reshape(n, k)
    scales = d.reshape(n, k // 32)
    return GroupQuantized(q, scales, -8 * scales, 4, 32)


def _q4_1(blocks: np.ndarray, n: int, k: int) -> GroupQuantized:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:], 16).reshape(n, k)
    return GroupQuantized(q, d.reshape(n, k // 32), m.reshape(n, k // 32), 4, 32)


def _q8_0(blocks: np.ndarray, n: int, k: int) -> GroupQuantized:
    d = _f16(blocks[:, :2])
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(n, k)
    return GroupQuantized(q, d.reshape(n, k // 32), None, 8, 32)


def _q4_k(blocks: np.ndarray, n: int, k: int) -> GroupQuantized:
    n_blocks = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    # 12 bytes of 6-bit scales and mins, 8 each (llama.cpp's get_scale_min_k4)
    s = blocks[:, 4:16].reshape(n_blocks, 3, 4)
    lo, hi, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = d[:, None] * sc.astype(np.float32)  # [n_blocks, 8]
    zeros = -(dmin[:, None] * mn.astype(np.float32))
    q = _nibbles(blocks[:, 16:], 32).reshape(n, k)
    return GroupQuantized(q, scales.reshape(n, k // 32), zeros.reshape(n, k // 32), 4, 32)


def _q6_k(blocks: np.ndarray, n: int, k: int) -> GroupQuantized:
    n_blocks = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = _nibbles(ql, 64).reshape(n_blocks, 8, 32)  # per 128-element half: 64 low, 64 high
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n_blocks, 2, 1, 32) >> shifts) & np.uint8(0x03)).reshape(n_blocks, 8, 32)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, k)
    scales = (d[:, None] * sc).reshape(n, k // 16)
    return GroupQuantized(q, scales, None, 8, 16)


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
