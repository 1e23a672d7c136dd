"""A Llama-family pipeline stage's decode step as one C++ call on the CPU (fused_decode_cpu.cpp).

Single-stream decode of a small model is bound by per-op overhead, not by the matmuls: SmolLM2's
30 layers make ~1200 torch ops and ~500 module calls a token. `DecodeStack` runs the same layers
(RMSNorm with the residual add, QKV, RoPE, the KV-cache write, paged decode attention, O,
SiLU-gated MLP; on the model's last stage its final RMSNorm too) in one call, with the same
kernels for the heavy parts: the
packed quantized matmuls (quantization/kernels.py), the paged decode attention kernel
(paged_attention_cpu.py) and torch's GEMM for float weights. Results match the module path up to
float rounding (reduction order in the norms, FMA contraction).

`DecodeStack.for_step` returns the stack when a step can take it, None otherwise (the caller runs
its modules): CPU float32 or bfloat16 (activations, norms and KV cache of one dtype), a
decode-only step of at most SMALL_BATCH tokens, tensor parallel size 1, the torch attention
backend with the C++ kernels built, every layer's MLP SiLU-gated. In bfloat16 the elementwise
steps round where torch's bfloat16 ops round, and a packed weight multiplies more than
BF16_SMALL_BATCH rows through its bfloat16 tiles, as the module path does.
LLMCTL_FUSED_DECODE=0 turns it off. The extension is compiled with the other CPU kernels at
set-up (`python -m llmctl.engine.kernels.cpu.cpu_kernels`), else on first use.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from llmctl.engine.forward_context import get_attn_metadata

logger = logging.getLogger("llmctl")

_SOURCE = tuple(
    Path(__file__).with_name(name)
    for name in ("fused_decode_cpu.cpp", "layer_ops_cpu.cpp", "layer_ops_cpu.h")
)
_PREFIX = "llmctl_fused_decode"
_EMPTY = torch.empty(0)


def enabled() -> bool:
    return os.environ.get("LLMCTL_FUSED_DECODE", "1") != "0"


class DecodeStack:
    """The C++ stack of `layers` (LlamaDecoderLayer), rebuilt when the KV caches are rebound."""

    def __init__(self, layers: Sequence[nn.Module], ops: list[str], tile_from: int):
        _remember_caches(self, layers)
        tensors, meta = _flatten(layers, tile_from)
        attn = layers[0].self_attn.attn
        eps = layers[0].input_layernorm.variance_epsilon
        namespace = getattr(torch.classes, _namespace())
        self.stack = namespace.DecodeStack(tensors, meta, float(eps), float(attn.scale), ops)

    def current(self, layers: Sequence[nn.Module]) -> bool:
        """Whether this was built for `layers` (the model's one list of them) and their
        attention layers still hold the KV caches it writes. Checked every step: plain attribute
        reads, not a walk through the modules (that was ~0.1 ms a token)."""
        if layers is not self.layers:
            return False
        return all(a.kv_cache is c for a, c in zip(self.attentions, self.caches, strict=True))

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        final_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the stage's layers; with `final_norm` (the model's RMSNorm
        weight, on the last stage) the hidden states come back normalised as the model's
        output."""
        md = get_attn_metadata()
        return self.stack.forward(
            hidden,
            residual,
            positions,
            md.slot_mapping,
            md.decode_block_tables,
            md.decode_seq_lens,
            md.sliding_window,
            final_norm,
        )

    @staticmethod
    def for_step(owner: nn.Module, layers: Sequence[nn.Module], hidden: torch.Tensor):
        """`owner`'s stack for this step's `layers`, or None when the step cannot take it."""
        from llmctl.engine.kernels.cpu.quantized_matmul import SMALL_BATCH

        if not (
            layers
            and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.device.type == "cpu"
            and hidden.dim() == 2
            and hidden.shape[0] <= SMALL_BATCH
        ):
            return None
        md = get_attn_metadata()
        if md is None or md.prefills or md.num_decodes != hidden.shape[0]:
            return None
        stack = owner.__dict__.get("_fused_decode_stack")
        if stack is not None and stack.current(layers):
            return stack if isinstance(stack, DecodeStack) else None
        # Decided again whenever the KV caches are rebound (a step before they are bound is no
        # reason to give up the stack for good).
        ops = _ops_for(layers)
        stack = DecodeStack(layers, *ops) if ops is not None else _NoStack(layers)
        owner.__dict__["_fused_decode_stack"] = stack
        return stack if isinstance(stack, DecodeStack) else None


class _NoStack:
    """The decision that `layers`, with their current KV caches, run their modules."""

    def __init__(self, layers: Sequence[nn.Module]):
        _remember_caches(self, layers)

    current = DecodeStack.current


def _remember_caches(stack, layers: Sequence[nn.Module]) -> None:
    """What `current` compares: the layer list, its attention layers and their KV caches."""
    stack.layers = layers
    stack.attentions = [layer.self_attn.attn for layer in layers]
    stack.caches = [a.kv_cache for a in stack.attentions]


def _ops_for(layers: Sequence[nn.Module]) -> tuple[list[str], int] | None:
    """The kernels' op names and the bfloat16 rows from which packed weights run their tiles
    when `layers` can run fused, else None (said once, at debug)."""
    from llmctl.engine.attention.layer import use_triton
    from llmctl.engine.distributed.parallel_state import get_tp_group
    from llmctl.engine.kernels.cpu import paged_attention_cpu
    from llmctl.engine.kernels.cpu import quantized_matmul as kernels

    reason = None
    if not enabled():
        reason = "LLMCTL_FUSED_DECODE=0"
    elif get_tp_group().world_size != 1:
        reason = "tensor parallel"
    elif use_triton(torch.device("cpu")):
        reason = "the Triton attention backend"
    elif not all(_fusable(layer) for layer in layers):
        reason = "a layer that is not a float32 or bfloat16 SiLU-gated Llama layer"
    elif _namespace() is None or paged_attention_cpu._kernel() is None:
        reason = "a CPU kernel is not built"
    if reason is not None:
        logger.debug("fused decode off: %s", reason)
        return None
    quantized = kernels._kernel()
    attention = paged_attention_cpu._kernel()
    int4 = int8 = tiled = ""
    if quantized is not None:
        int4 = quantized.int4_group_mm._qualified_op_name
        int8 = quantized.int8_group_mm._qualified_op_name
        tiled = quantized.tiled_group_mm._qualified_op_name
    needs_int = any(
        part.bits > 0 for layer in layers for lin in _linears(layer) for part in _parts(lin)
    )
    if needs_int and not int4:
        logger.debug("fused decode off: the quantized matmul kernel is not built")
        return None
    bf16 = layers[0].input_layernorm.weight.dtype == torch.bfloat16
    tile_from = kernels.BF16_SMALL_BATCH if bf16 and kernels._bf16_tiles() else 0
    return [int4, int8, tiled, attention._qualified_op_name], tile_from


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


class _Part:
    def __init__(self, bits: int, group: int, q: torch.Tensor, scales=None, zeros=None):
        self.bits, self.group, self.q = bits, group, q
        self.scales = _EMPTY if scales is None else scales
        self.zeros = _EMPTY if zeros is None else zeros


def _parts(linear: nn.Module) -> list[_Part]:
    method = linear.quant_method
    if method is None:
        if linear._packed is not None:  # oneDNN's prepacked copy (linear.py)
            return [_Part(-1, 0, linear._packed)]
        return [_Part(0, 0, linear.weight)]
    parts = []
    for p in method.parts:
        if hasattr(p, "qweight"):  # PackedLinearWeight
            parts.append(_Part(p.bits, p.group_size, p.qweight, p.scales, p.zeros))
        else:  # _FloatRows
            parts.append(_Part(0, 0, p.weight))
    return parts


def _fusable(layer: nn.Module) -> bool:
    from llmctl.engine.layers.activation import SiluAndMul

    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    if attn is None or not isinstance(getattr(mlp, "act_fn", None), SiluAndMul):
        return False
    if attn.qk_norm:  # Qwen3's per-head q/k norm: not in the C++ layer
        return False
    dtype = layer.input_layernorm.weight.dtype  # the model's: activations, norms, KV cache
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if attn.attn.kv_cache.dtype != dtype or attn.attn.kv_cache.numel() == 0:
        return False
    if layer.post_attention_layernorm.weight.dtype != dtype:
        return False
    if attn.rotary_emb.cos_cache.dtype != torch.float32 or attn.head_dim % 2:
        return False
    for linear in _linears(layer):
        if linear.quant_method is None and linear.weight.dtype != dtype:
            return False
        for part in _parts(linear):
            if part.bits == 0 and part.q.dtype != dtype:
                return False
    return True


def _flatten(layers: Sequence[nn.Module], tile_from: int) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors and integers DecodeStack's constructor reads (see fused_decode_cpu.cpp)."""
    first = layers[0].self_attn
    rotary = first.rotary_emb
    tensors: list[torch.Tensor] = [rotary.cos_cache, rotary.sin_cache]
    meta = [len(layers), first.attn.num_heads, first.attn.num_kv_heads, first.head_dim, tile_from]
    for layer in layers:
        attn = layer.self_attn
        tensors += [
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            attn.attn.kv_cache,
        ]
        for linear in _linears(layer):
            parts = _parts(linear)
            meta += [len(parts), int(linear.bias is not None)]
            for part in parts:
                meta += [part.bits, part.group]
                tensors += [part.q, part.scales, part.zeros]
            if linear.bias is not None:
                tensors.append(linear.bias)
    return [t.detach() for t in tensors], meta


@functools.cache
def _namespace() -> str | None:
    from llmctl.engine.kernels.cpu.cpu_extension import compile_extension, first_error_line

    try:
        return compile_extension(_SOURCE, _PREFIX, "CPU fused decode kernel", "native", ())
    except Exception as e:  # no compiler: the module path runs, one warning says so
        logger.warning(
            "CPU fused decode unavailable, decoding layer by layer: %s", first_error_line(e)
        )
        return None


def kernel_available() -> bool:
    return _namespace() is not None
