"""Block FP8 (DeepSeek-V3's format, quantization_config.quant_method "fp8"): float8_e4m3fn weights
with one float32 scale (weight_scale_inv) per weight_block_size block, 128 x 128 in every model
that ships it; W = fp8 * scale_inv. Edge blocks are partial when a dimension is not a multiple of
the block.

- `quantize_blocks`: per-block round-to-nearest of float weights (`--quantization fp8` on a bf16
  checkpoint, and the tests' checkpoints): scale = max|w| / 448 (e4m3's largest), w / scale
  rounded to the nearest FP8 value.
- `packed_weight`: checkpoint rows (FP8 bits and their block scales) -> the Fp8LinearWeight the
  layers hold (kernels/cpu/fp8_matmul.py), each row with its block's scales.
- `check_block_split`: a tensor-parallel size whose split of a layer's rows (column parallel) or
  inputs (row parallel) starts or ends inside a block is refused, naming the sizes that do not:
  a rank's slice must be whole blocks, as vLLM requires (a split may end at the tensor's own
  partial edge).
- `check_fp8_device`: FP8 GEMMs need compute capability 8.9 (Ada, Hopper) and Triton on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmctl.engine.errors import ConfigError, UnsupportedQuantizationError

if TYPE_CHECKING:
    import torch

    from llmctl.engine.config.model_shape import ModelShape
    from llmctl.engine.kernels.cpu.fp8_matmul import Fp8LinearWeight
    from llmctl.engine.layers.quantization.quant_config import QuantizationConfig

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
DEFAULT_BLOCK = (128, 128)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK):
    """w [N, K] float -> (q float8_e4m3fn [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)])."""
    import torch
    import torch.nn.functional as F

    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = F.pad(w.detach().to(torch.float32), (0, cols * bk - k, 0, rows * bn - n))
    tiles = padded.view(rows, bn, cols, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # [rows, cols]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block=DEFAULT_BLOCK):
    """float32 [N, K] of FP8 weights and their block scales (the reference)."""
    import torch

    bn, bk = block
    n, k = q.shape
    s = scale_inv.to(torch.float32).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return q.to(torch.float32) * s[:n, :k]


def packed_weight(
    q: torch.Tensor, scale_inv: torch.Tensor, first_row: int, block: tuple[int, int]
) -> Fp8LinearWeight:
    """Rows [first_row, first_row + len(q)) of a checkpoint tensor whose block scales
    `scale_inv` start at block row first_row // bn (columns from a block boundary) -> the layer's
    Fp8LinearWeight, each row with its block row's scales."""
    import torch

    from llmctl.engine.kernels.cpu.fp8_matmul import Fp8LinearWeight

    bn, bk = block
    n, k = q.shape
    block_rows = torch.arange(first_row, first_row + n) // bn - first_row // bn
    scales = scale_inv.to(torch.float32)[block_rows, : -(-k // bk)].contiguous()
    bits = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q.to(torch.uint8)
    return Fp8LinearWeight(n, k, bk, bits.contiguous(), scales)


def quantize_rows(w: torch.Tensor, block: tuple[int, int]) -> Fp8LinearWeight:
    """Float rows (a rank's whole-block slice) -> an Fp8LinearWeight, round-to-nearest."""
    q, scale_inv = quantize_blocks(w, block)
    return packed_weight(q, scale_inv, 0, block)


# -- which tensor-parallel sizes keep whole blocks -------------------------------------------


def _spans(sizes: list[int], starts: list[int] | None = None) -> list[tuple[int, int]]:
    from llmctl.engine.distributed.partition import offsets

    starts = starts if starts is not None else offsets(sizes)
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _splits(shape: ModelShape, tp: int, expert_parallel: bool) -> list[tuple[str, str, list, int]]:
    """(layer, "rows" or "inputs", each rank's [start, end), the full size) of every FP8 layer
    tensor parallelism splits (kv_b_proj is held in float; embeddings and the LM head too)."""
    from llmctl.engine.distributed.partition import column_shards

    heads = shape.tensor_parallel_heads(tp)
    out = []
    if shape.is_mla:
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        q_name = "q_b_proj" if shape.q_lora_rank else "q_proj"
        out.append((q_name, "rows", _spans([h.num_q_heads * qk for h in heads])))
        v = shape.v_head_dim
        out.append(("o_proj", "inputs", _spans([h.num_q_heads * v for h in heads])))
    else:
        d = shape.head_dim
        out.append(("q_proj", "rows", _spans([h.num_q_heads * d for h in heads])))
        kv = _spans([h.num_kv_heads * d for h in heads], [h.kv_start * d for h in heads])
        out += [("k_proj", "rows", kv), ("v_proj", "rows", kv)]
        out.append(("o_proj", "inputs", _spans([h.num_q_heads * d for h in heads])))
    mlps = []
    if not all(shape.is_moe_layer(i) for i in range(shape.num_layers)):
        mlps.append(("", shape.intermediate_size))
    if shape.num_experts and not expert_parallel:
        mlps.append(("expert ", shape.expert_intermediate_size))
    if shape.shared_expert_intermediate_size:
        mlps.append(("shared expert ", shape.shared_expert_intermediate_size))
    for what, size in mlps:
        spans = _spans(column_shards(size, tp, "MLP features"))
        out += [(f"{what}gate_up_proj", "rows", spans), (f"{what}down_proj", "inputs", spans)]
    return [(name, kind, spans, max(end for _, end in spans)) for name, kind, spans in out]


def block_cuts(
    shape: ModelShape, tp: int, block: tuple[int, int], expert_parallel: bool = False
) -> list[str]:
    """The FP8 layers whose slices on `tp` ranks cut a block: "o_proj inputs [0, 96) of 192
    (blocks of 128)"; a slice may end at the tensor's own edge."""
    cuts = []
    for name, kind, spans, full in _splits(shape, tp, expert_parallel):
        size = block[0] if kind == "rows" else block[1]
        for start, end in spans:
            if start % size or (end % size and end != full):
                cuts.append(f"{name} {kind} [{start}, {end}) of {full} (blocks of {size})")
                break
    return cuts


def check_block_split(
    shape: ModelShape, tp: int, quant: QuantizationConfig, expert_parallel: bool = False
) -> None:
    """ConfigError naming the tensor-parallel sizes that keep whole blocks, when `tp` cuts one."""
    block = quant.weight_block_size
    cuts = block_cuts(shape, tp, block, expert_parallel) if tp > 1 else []
    if not cuts:
        return
    from llmctl.engine.distributed.partition import valid_tp_sizes

    sizes = valid_tp_sizes(shape.num_attention_heads, shape.num_kv_heads)
    whole = []
    for size in sizes:
        try:
            if not block_cuts(shape, size, block, expert_parallel):
                whole.append(str(size))
        except ConfigError:
            continue
    hint = f"use tensor_parallel_size {', '.join(whole)}, or --pipeline-parallel-size"
    if shape.num_experts and not expert_parallel and any(c.startswith("expert") for c in cuts):
        hint += ", or --enable-expert-parallel (whole experts per rank)"
    raise ConfigError(
        f"tensor_parallel_size={tp} would cut the {block[0]}x{block[1]} FP8 blocks: "
        f"{'; '.join(cuts)}",
        hint,
    )


def check_fp8_device(device: str, capability: tuple[int, int] | None, has_triton: bool) -> None:
    """UnsupportedQuantizationError when block-FP8 weights cannot run on `device` (CUDA:
    `capability` of the GPU)."""
    if device != "cuda":
        return  # the CPU: weight-only, FP8 decoded in the matmul kernel
    if capability is not None and capability < (8, 9):
        raise UnsupportedQuantizationError(
            f"FP8 weights need FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell); this GPU is {capability[0]}.{capability[1]}",
            "run a bfloat16 checkpoint of the model, or --device cpu (FP8 weight-only)",
        )
    if not has_triton:
        raise UnsupportedQuantizationError(
            "FP8 weights on CUDA run a Triton GEMM, and Triton is not installed",
            "pip install triton (it comes with the CUDA builds of torch)",
        )
