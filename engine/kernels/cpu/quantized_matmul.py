"""A packed, group-quantized weight and its matmul: y = x W^T with W never materialised in float.

The contract every format is converted to at load time (GGUF blocks, round-to-nearest int8/int4):

    W[n, k] = q[n, k] * scales[n, k // group_size] + zeros[n, k // group_size]

with q unsigned in [0, 15] for bits=4 and signed in [-128, 127] for bits=8 (zeros None: symmetric).
N is the output features (rows, split by column-parallel layers), K the input features (split by
row-parallel layers in whole groups).

Kernels (quantized_matmul_cpu.cpp, quantized_matmul_bf16.cpp, amx_gemm.cpp and int8_gemm.cpp,
one extension compiled on first use like the paged-attention kernel, with AVX-512 / AVX2 / scalar
paths picked for the CPU that builds it):
- M <= SMALL_BATCH rows (decode): int8_group_mm / int4_group_mm read each weight byte once and
  dequantize in registers; accumulation is float32, the output rounded back to x's dtype.
  bfloat16 rows are widened to float32 in the kernel, except against int4 weights on CPUs with
  AVX512-BF16 and 256-bit loops (Zen 4), where VDPBF16PS multiplies each nibble's exact bfloat16
  value by x as it is (exact products, float32 sums; 1.27x the widening loops' rate there).
- bfloat16 x on a CPU whose path has bfloat16 tiles (platform.cpu_path: AMX or AVX512-BF16),
  more than BF16_SMALL_BATCH rows: tiled_group_mm expands tiles of W into bfloat16 rows, the A
  operand of oneDNN's brgemm kernel (y^T = W x^T), and multiplies them on AMX tiles (or
  AVX512-BF16 dot products) into float32 sums; from BF16_LARGE_BATCH rows, W in bfloat16 chunks
  for torch's bfloat16 GEMM, or on the AMX path W expanded once into AMX's B layout
  (vnni_blocks_bf16) for our own tile loop (amx_linear, amx_gemm.cpp: N and K multiples of 32;
  a Llama MLP there is one call, layers/gated_mlp.py). The tiles hold exactly the float path's
  weights in bfloat16 (W dequantized, rounded to nearest). On the Intel AMX kind, 2 threads,
  SmolLM2's layer shapes at M = 64 (best of 3 medians, 2026-11-27): QKV 73 us, O 55, gate/up
  187, down 117, LM head (Q8_0) 3.6 ms, against F.linear on the bfloat16 weights 73 / 51 / 215 /
  115 us and 4.8 ms (runs on that VM vary by up to 1.5x). The decode kernels stay up to 4 rows:
  at M = 1 they read each weight byte once, where the tiles expand every weight.
- From INT8_LARGE_BATCH rows on the AVX512-BF16 path with AVX512-VNNI (Zen 4,
  platform.CpuPath.int8_prefill), int8_gemm.cpp instead: x quantized to int8 per 32 values
  (llama.cpp's rule), W laid out once a call as bytes for VPDPBUSD (int8_blocks), ~1.35x
  oneDNN's bfloat16 GEMM at SmolLM2's shapes there; the one place the CPU's activations are
  not the float path's (prefill_gemm says which GEMM runs).
- From INT8_FLOAT32_BATCH float32 rows on the AVX2 path (Zen 1-3, CpuPath.int8_prefill, dtype
  "auto": PackedLinearWeight.int8_act) against 4-bit weights: int4_group_mm_int8_act, the same
  int8 numerics from float32 x on VPMADDUBSW (16-bit sums that 4-bit weights cannot overflow),
  W laid out in int8_blocks' panels each call (in cache, a panel at a time, below 256 rows).
  On the Zen 4 kind built for Zen 3 (AVX2 only, 2 threads), SmolLM2's shapes: 1.8-2.0x the
  float32 tiles at M = 32-64, 1.5-2.6x at 128-512, 1.0-2.0x the chunks at M = 8192
  (float32_int8); W2's decode steps (64 sequences) 1.6x. The numerics, teacher-forced over
  2,305 positions of the bundled model (benchmarks/activation_numerics.py): int8 activations
  pick float32's top token at 96.96% of positions, bfloat16 activations (dtype "auto" where the
  CPU has them) at 96.79%; the 8-bit LM head keeps float32 (with it quantized too, 96.18%).
  Below INT8_FLOAT32_BATCH rows (a short prompt alone, fewer sequences decoding) float32: the
  bundled model's first answer token to "What is the capital of France?" (a 37-token prompt)
  is a near tie ("The" 0.08 nats above "L") that int8 activations tip into French nonsense,
  as llama.cpp's own do.
The float32 paths (AVX2 CPUs with LLMCTL_CPU_INT8_PREFILL=0, or float32 activations anywhere,
8-bit weights):
- larger M (prefill): tiled_group_mm expands tiles of W to float32 (about 1 MiB each) and runs
  torch's float GEMM on them, every tile on one thread inside a single parallel region, so the
  dequantization is amortised over the M rows.
- M >= LARGE_BATCH (a long prompt, or many): W is expanded in chunks of up to 16 MiB (the whole
  weight for most layers of a small model) by all threads, then one GEMM per chunk runs on all
  of them: at these M the expansion is cheap next to the GEMM, and one large GEMM runs faster
  than many tile-sized ones and needs no transposed copy of the output (0.6-0.7x the tiled
  path's time on the bundled model's layer shapes at M = 8192: benchmarks/quantized_matmul.py).
PyTorch's `aten._weight_int4pack_mm_for_cpu` was measured against these (benchmarks/
quantized_matmul.py) and is not used: slower at M=1 and M=64 on the shapes that matter, it needs N
a multiple of 16, its fast path rounds activations to bf16 and its float32 path is scalar.
`aten._weight_int8pack_mm` has per-channel scales only, not groups.

Without a C++ compiler (or if the build fails) the same math runs in plain torch: every matmul
dequantizes tiles and calls F.linear (correct, slower at decode); one warning says why.

On a GPU the matmul is the custom op llmctl::group_quantized_mm (triton_group_mm.py; CUDA graphs
capture it): at every M one Triton kernel expands tiles of W in registers for tl.dot, W never
written out. Activations keep their dtype (bfloat16 on the GPU by default) and accumulate in
float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmctl.engine import envs

logger = logging.getLogger("llmctl")

_SOURCE = tuple(
    Path(__file__).with_name(name)
    for name in (
        "quantized_matmul_cpu.cpp",
        "quantized_matmul_bf16.cpp",
        "quantized_matmul_cpu.h",
        "amx_gemm.cpp",
        "int8_gemm.cpp",
        "layer_ops_cpu.h",
        "transpose16.h",
    )
)
_PREFIX = "llmctl_quantized_matmul"
SMALL_BATCH = 24  # rows of x up to which the fused kernels beat dequantize + GEMM (measured)
BF16_SMALL_BATCH = 4  # the same against bfloat16 tiles for AMX (measured on the Intel AMX kind)
_TILE_BYTES = 1 << 20  # float32 bytes of W expanded per tile on the batched path
LARGE_BATCH = 512  # rows of x from which W is expanded in large chunks for one GEMM each
# The same for bfloat16 tiles: at 512 rows the tiles took 1.3-2.3x the chunks' time on SmolLM2's
# layer shapes (Intel AMX kind, 2 threads), at 256 about the same, at 128 and below less.
BF16_LARGE_BATCH = 256
# From this many rows the int8 prefill GEMM (Zen 4) takes over from the bfloat16 tiles: at 128 rows
# 1.1-1.3x their time on SmolLM2's layer shapes, at 64 even, at 32 0.8-0.9x (2 threads).
INT8_LARGE_BATCH = 128
# From this many float32 rows the AVX2 path's 4-bit weights take int8 activations (int8_act):
# 64 sequences decoding, or a prompt of 64 tokens (module docstring: why not fewer)
INT8_FLOAT32_BATCH = 64
_CHUNK_BYTES = 16 << 20  # float32 bytes of W expanded at once on that path


# Set while a model whose config has int8_activations loads (model_loader.loader): the packed
# weights made then take int8 activations for float32 batches (PackedLinearWeight.int8_act).
_INT8_ACTIVATIONS = contextvars.ContextVar("llmctl_int8_activations", default=False)


@contextlib.contextmanager
def int8_activations(enabled: bool) -> Iterator[None]:
    """Packed weights made inside take int8 activations for float32 batches (where the CPU path
    and the build allow: float32_int8); outside, or with enabled False, they do not."""
    token = _INT8_ACTIVATIONS.set(enabled)
    try:
        yield
    finally:
        _INT8_ACTIVATIONS.reset(token)


@dataclass(eq=False)
class PackedLinearWeight:
    """The weight of one linear layer, packed for the kernels.

    qweight: bits=8: int8 [N, K]; bits=4: uint8 [N, K // 2], each 32-element chunk of a row in
    16 bytes, byte j = q[j] | q[j + 16] << 4 (GGUF's Q4_0 nibble order).
    scales, zeros: [N, K // group_size], float32, or float16 where those are exact (GGUF's
    Q4_0, Q4_1 and Q8_0 scales); zeros is None for bits=8 and of the scales' dtype otherwise.
    """

    out_features: int  # N
    in_features: int  # K
    bits: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    # float32 batches of INT8_FLOAT32_BATCH rows or more on int8 activations (4-bit weights, the
    # AVX2 path): the model's config asked for it (ModelConfig.int8_activations) when this was made
    int8_act: bool = False

    def __post_init__(self) -> None:
        if _INT8_ACTIVATIONS.get():
            self.int8_act = True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] float -> [..., N] in x's dtype (float32 sums)."""
        op = _loaded_op
        if op is not None and x.dim() == 2 and x.is_cpu and x.is_contiguous():
            rows = x.shape[0]
            # decode: straight to the kernel (a decode step makes ~4 of these calls a layer)
            if x.dtype == torch.float32:
                if rows <= SMALL_BATCH:
                    return self._decode_mm(op, x)
                if rows >= INT8_FLOAT32_BATCH and self._takes_int8_act(op):
                    return self._int8_act_mm(op, x)
            if x.dtype == torch.bfloat16 and _bf16_tiles():
                if rows <= BF16_SMALL_BATCH:
                    return self._decode_mm(op, x)
                return self._bf16_matmul(op, x)
        lead = x.shape[:-1]
        if not x.is_cpu and _triton_available():  # the GPU: one Triton kernel, x's dtype
            from llmctl.engine.kernels.triton import triton_ops  # noqa: F401  (registers llmctl::*)

            y = torch.ops.llmctl.group_quantized_mm(
                x.reshape(-1, self.in_features),
                self.qweight,
                self.scales,
                self.zeros,
                self.bits,
                self.group_size,
            )
            return y.reshape(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features)
        op = _kernel() if x2.device.type == "cpu" else None
        if op is not None and x.dtype == torch.bfloat16 and _bf16_tiles():
            return self.matmul(x2.contiguous()).reshape(*lead, self.out_features)
        x2 = x2.to(torch.float32).contiguous()
        if op is not None and x2.shape[0] >= INT8_FLOAT32_BATCH and self._takes_int8_act(op):
            y = self._int8_act_mm(op, x2)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        if op is not None and x2.shape[0] <= SMALL_BATCH:
            y = self._decode_mm(op, x2)
        else:
            y = self._tiled_matmul(x2)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def _decode_mm(self, op: Any, x: torch.Tensor) -> torch.Tensor:
        """The decode kernels: each weight byte read once for all rows of x (float32 or
        bfloat16, widened in the kernel; the output in x's dtype)."""
        if self.bits == 8:
            return op.int8_group_mm(x, self.qweight, self.scales, self.group_size)
        return op.int4_group_mm(x, self.qweight, self.scales, self.zeros, self.group_size)

    def prefill_kind(self, op: Any) -> str | None:
        """Which of our prefill GEMMs takes this weight (`prefill_gemm`), if its shape fits:
        N and K multiples of 32; int8 also wants whole 32-value blocks per scale."""
        kind = prefill_gemm(op)
        if self.out_features % 32 or self.in_features % 32:
            return None
        if kind == "int8" and self.group_size % 32:
            return None
        return kind

    def _takes_int8_act(self, op: Any) -> bool:
        """float32 batches of INT8_FLOAT32_BATCH rows or more (the caller checks) on int8
        activations, as on the Zen 4 path: where the model asked for them (int8_act) and the
        CPU path and build allow (float32_int8); 4-bit weights only (8-bit weights' byte
        products overflow VPMADDUBSW's 16-bit sums), N and K multiples of 32, whole 32-value
        blocks per scale."""
        return (
            self.int8_act
            and self.bits == 4
            and self.out_features % 32 == 0
            and self.in_features % 32 == 0
            and self.group_size % 32 == 0
            and float32_int8(op)
        )

    def _int8_act_mm(self, op: Any, x: torch.Tensor) -> torch.Tensor:
        """float32 x quantized to int8 per 32 values, times the 4-bit W (int8_gemm.cpp)."""
        return op.int4_group_mm_int8_act(x, self.qweight, self.scales, self.zeros, self.group_size)

    def prefill_blocks(self, op: Any, kind: str, gate_up_half: int = 0) -> torch.Tensor:
        """W laid out once a call for the prefill GEMM `kind` (gate_up_half: gate and up rows
        side by side): "amx", expanded to bfloat16 in AMX's B layout (vnni_blocks_bf16: [N / 32,
        K / 2, 32, 2]); "int8", unsigned bytes for VPDPBUSD with the blocks' scales (int8_blocks:
        [N / 32, 40 K] bytes)."""
        lay_out = op.vnni_blocks_bf16 if kind == "amx" else op.int8_blocks
        return lay_out(
            self.qweight, self.scales, self.zeros, self.bits, self.group_size, gate_up_half
        )

    def _bf16_matmul(self, op: Any, x: torch.Tensor) -> torch.Tensor:
        """bfloat16 x of more than BF16_SMALL_BATCH rows: W expanded to bfloat16 tiles for
        oneDNN's brgemm (AMX or AVX512-BF16); from prefill_rows(kind) rows our prefill GEMM
        where the path has one (prefill_gemm), else from BF16_LARGE_BATCH rows W in large
        chunks for torch's bfloat16 GEMM."""
        n, k = self.out_features, self.in_features
        if x.shape[0] >= INT8_LARGE_BATCH:
            kind = self.prefill_kind(op)
            if kind is not None and x.shape[0] >= prefill_rows(kind):
                return getattr(op, f"{kind}_linear")(x, self.prefill_blocks(op, kind))
        if x.shape[0] >= BF16_LARGE_BATCH:
            return self._chunked_matmul(x, max(8, _CHUNK_BYTES // (2 * k)))
        rows = bf16_tile_rows(n, torch.get_num_threads())
        q, s, z = self.qweight, self.scales, self.zeros
        return op.tiled_group_mm(x, q, s, z, self.bits, self.group_size, rows)

    def dequantize(
        self, start: int = 0, end: int | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rows [start, end) of W in float32 (or those values rounded to bfloat16): embedding
        rows, references, the batched path."""
        end = self.out_features if end is None else end
        op = _kernel() if self.qweight.device.type == "cpu" else None
        if op is not None:
            expand = op.dequantize_rows_bf16 if dtype == torch.bfloat16 else op.dequantize_rows
            w = expand(
                self.qweight, self.scales, self.zeros, self.bits, self.group_size, start, end
            )
        else:
            w = self._dequantize_torch(start, end)
        return w.to(dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape of int64) of W in float32: [*ids.shape, K], a token embedding
        lookup that expands only the rows asked for."""
        flat = ids.reshape(-1)
        if flat.numel() == 1 and self.qweight.is_cpu:  # a decode step's token: its row in place
            n = int(flat[0])
            if not 0 <= n < self.out_features:
                raise IndexError(f"token id {n} is outside the {self.out_features} embedding rows")
            return self.dequantize(n, n + 1).reshape(*ids.shape, self.in_features)
        rows = PackedLinearWeight(
            flat.numel(),
            self.in_features,
            self.bits,
            self.group_size,
            self.qweight.index_select(0, flat),
            self.scales.index_select(0, flat),
            None if self.zeros is None else self.zeros.index_select(0, flat),
        )
        return rows.dequantize().reshape(*ids.shape, self.in_features)

    def to(self, device: torch.device | str) -> PackedLinearWeight:
        """This weight on `device` (itself when it is there already)."""
        if self.qweight.device == torch.device(device):
            return self
        z = None if self.zeros is None else self.zeros.to(device)
        return dataclasses.replace(
            self, qweight=self.qweight.to(device), scales=self.scales.to(device), zeros=z
        )

    @classmethod
    def cat(cls, parts: list[PackedLinearWeight]) -> PackedLinearWeight:
        """The rows of `parts` (one format, one K) stacked in order: a fused layer's weight."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if any(
            (p.in_features, p.bits, p.group_size)
            != (first.in_features, first.bits, first.group_size)
            or (p.zeros is None) != (first.zeros is None)
            for p in parts
        ):
            raise ValueError("packed parts differ in format or in_features")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return cls(
            sum(p.out_features for p in parts),
            first.in_features,
            first.bits,
            first.group_size,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            zeros,
            first.int8_act,
        )

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds in memory (packed data, scales and zeros)."""
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        if x.shape[0] >= LARGE_BATCH:
            return self._chunked_matmul(x, max(8, _CHUNK_BYTES // (4 * k)))
        rows = float32_tile_rows(n, k, torch.get_num_threads())
        op = _kernel() if x.device.type == "cpu" else None
        if op is not None:
            q, s, z = self.qweight, self.scales, self.zeros
            return op.tiled_group_mm(x, q, s, z, self.bits, self.group_size, rows)
        return self._chunked_matmul(x, rows)  # no kernel: plain torch

    def _chunked_matmul(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """y = x W^T with `rows` rows of W expanded at a time (by all threads), one GEMM per
        chunk written straight into its columns of y."""
        n = self.out_features
        if rows >= n:
            w = self.dequantize(dtype=x.dtype)
            if (
                x.dtype == torch.bfloat16
                and torch.backends.mkldnn.is_available()
                and envs.LLMCTL_CPU_PREPACK
            ):
                # W reordered into oneDNN's blocked layout, then the GEMM the float path's
                # prepacked weights run (layers/linear.py): at W3's shapes on the Zen 4 kind
                # (M = 8192, 2 threads) 156 ms a layer against 164 for F.linear on the plain
                # bfloat16 W, whose GEMM repacks B itself, and 154 with a weight packed once.
                packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            return F.linear(x, w)
        y = x.new_empty(x.shape[0], n)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            torch.mm(x, self.dequantize(start, end, x.dtype).t(), out=y[:, start:end])
        return y

    def _dequantize_torch(self, start: int, end: int) -> torch.Tensor:
        g = self.group_size
        q = self.qweight[start:end]
        if self.bits == 4:  # [rows, K/32, 16] bytes -> [rows, K/32, 2, 16] nibbles
            b = q.view(q.shape[0], -1, 16)
            q = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(q.shape[0], -1)
        w = q.to(torch.float32).view(q.shape[0], -1, g) * self.scales[start:end, :, None].float()
        if self.zeros is not None:
            w += self.zeros[start:end, :, None].float()
        return w.view(q.shape[0], -1)


def bf16_tile_rows(n: int, threads: int) -> int:
    """Rows of W per bfloat16 tile for an n-row weight on `threads` threads: at most 128 (fewer
    brgemm calls, each with a fixed cost of ~2 us; 128 ran W2 ~3% faster than 64 on the AMX
    kind), a multiple of 16, and the same number of tiles for every thread where n allows (576
    rows on 2 threads: 6 tiles of 96, not 4 of 128 and one of 64 split 3 to 2, which left one
    thread idle a third of SmolLM2's O and down projections)."""
    per_thread = -(-n // max(1, threads))
    tiles = max(2, -(-per_thread // 128))  # per thread, two at least before rounding to 16
    rows = -(-per_thread // tiles)
    return min(128, max(16, -(-rows // 16) * 16))


def float32_tile_rows(n: int, k: int, threads: int) -> int:
    """Rows of W per float32 tile of tiled_group_mm for an [n, k] weight: ~1 MiB tiles, and at
    least two per thread so that the threads stay balanced (the fused decode stack takes the
    same, fused_decode.py)."""
    return max(8, min(max(16, _TILE_BYTES // (4 * k)), -(-n // (2 * threads))))


def pack_groups(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> PackedLinearWeight:
    """q: [N, K] integer (uint8 in [0, 15] for 4 bits, int8 for 8 bits); scales, zeros:
    [N, K // group_size] float (float16 kept as it is, else float32; zeros take the scales' dtype).
    K must be a multiple of group_size; for 4 bits group_size must be a
    multiple of 32. Raises ValueError otherwise. The inputs are not kept (q is repacked)."""
    n, k = q.shape
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; use 4 or 8")
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    if bits == 4 and group_size % 32:
        raise ValueError(f"4-bit group_size={group_size} is not a multiple of 32")
    if tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected {(n, k // group_size)}")
    if scales.dtype != torch.float16:
        scales = scales.to(torch.float32)
    scales = scales.contiguous()
    if bits == 8:
        if zeros is not None:
            raise ValueError("8-bit weights are symmetric: zeros must be None")
        qweight = q.to(torch.int8).contiguous()
    else:
        if zeros is None:
            raise ValueError("4-bit weights need zeros (use -8 * scales for a symmetric format)")
        zeros = zeros.to(scales.dtype).contiguous()
        nibbles = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
        qweight = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return PackedLinearWeight(n, k, bits, group_size, qweight, scales, zeros)


@functools.cache
def prefill_gemm(op: Any) -> str | None:
    """Our GEMM for prefill batches (prefill_rows(kind) rows and more) of bfloat16 activations:
    "amx", the AMX tile loop (amx_gemm.cpp, the float path's bfloat16 numerics), on the AMX
    path; "int8", int8 activations on AVX512-VNNI (int8_gemm.cpp), where the CPU path has
    int8_prefill (Zen 4); None elsewhere, or where the build lacks it (one for an older
    -march): torch's bfloat16 GEMM on chunks of W."""
    from llmctl.engine.platform import cpu_path

    path = cpu_path()
    if path.name == "amx" and op.amx_built():
        return "amx"
    if path.int8_prefill and path.bf16_tiles and op.int8_built():
        return "int8"
    return None


@functools.cache
def float32_int8(op: Any) -> bool:
    """Whether float32 batches of INT8_FLOAT32_BATCH rows or more on 4-bit weights run on int8
    activations (int4_group_mm_int8_act, VPMADDUBSW): the avx2 CPU path with int8_prefill, a build
    with AVX2 and FMA. Elsewhere float32 activations (dtype="float32" on a bfloat16 CPU) keep
    the float32 tiles, the float path's numerics."""
    from llmctl.engine.platform import cpu_path

    path = cpu_path()
    return path.name == "avx2" and path.int8_prefill and op.int8_f32_built()


def prefill_rows(kind: str) -> int:
    """Rows of x from which the prefill GEMM `kind` runs: BF16_LARGE_BATCH for AMX tiles,
    INT8_LARGE_BATCH for int8 activations."""
    return INT8_LARGE_BATCH if kind == "int8" else BF16_LARGE_BATCH


@functools.cache
def _bf16_tiles() -> bool:
    """Whether bfloat16 activations take the bfloat16 tiles (platform.cpu_path, decided once)."""
    from llmctl.engine.platform import cpu_path

    return cpu_path().bf16_tiles


def _triton_available() -> bool:
    from llmctl.engine.platform import triton_available

    return triton_available()


def kernel_available() -> bool:
    """True when the C++ kernels are built and loaded (building them now if needed)."""
    return _kernel() is not None


def build_in_background() -> threading.Thread:
    """Start building (or loading) the kernels on a daemon thread, so that the compile of a first
    run (10-30 s) overlaps with reading the weights; the first matmul waits for it."""
    thread = threading.Thread(target=_kernel, name="llmctl-quantized-kernel-build", daemon=True)
    thread.start()
    return thread


# -- building the kernel -----------------------------------------------------------------------

_build_lock = threading.Lock()


_loaded_op: Any | None = None  # the kernels' ops once loaded: the decode path's fast check


def _kernel() -> Any | None:
    global _loaded_op
    with _build_lock:  # one build per process; later calls return the cached op at once
        _loaded_op = _kernel_once()
        return _loaded_op


@functools.cache
def _kernel_once() -> Any | None:
    from llmctl.engine.kernels.cpu.cpu_extension import first_error_line

    try:
        return build_kernel()
    except Exception as e:  # a missing compiler, ninja or header: degrade, don't fail the engine
        logger.warning(
            "CPU quantized matmul kernel unavailable, dequantizing tiles for torch's matmul "
            "instead (slower decode): %s",
            first_error_line(e),
        )
        logger.debug("building the CPU quantized matmul kernel failed", exc_info=True)
        return None


def build_kernel(march: str = "native", extra_cflags: tuple[str, ...] = ()) -> Any:
    """Compile (or reuse) the kernels for -march=`march`; returns their op namespace
    (`.int8_group_mm`, `.int4_group_mm`, `.dequantize_rows`). Built once per source, flags,
    torch, Python and CPU features, in the paged-attention kernel's cache directory."""
    from llmctl.engine.kernels.cpu.cpu_extension import build_spec, compile_extension

    name = build_spec(_SOURCE, _PREFIX, march, extra_cflags)[0]
    if hasattr(torch.ops, name) and hasattr(getattr(torch.ops, name), "int8_group_mm"):
        return getattr(torch.ops, name)
    compile_extension(_SOURCE, _PREFIX, "CPU quantized matmul kernel", march, extra_cflags)
    return getattr(torch.ops, name)
