"""A Llama-family pipeline stage's decode step as one C++ call on the CPU (fused_decode_cpu.cpp).

Single-stream decode of a small model is bound by per-op overhead, not by the matmuls: SmolLM2's
30 layers make ~1200 torch ops and ~500 module calls a token. `DecodeStack` runs the same layers
(RMSNorm with the residual add, QKV, RoPE, the KV-cache write, paged decode attention, O,
SiLU-gated MLP; on the model's last stage its final RMSNorm too) in one call, with the same
kernels for the heavy parts: the packed quantized matmuls (quantized_matmul.py), the paged
decode attention kernel (paged_attention_cpu.py) and torch's GEMM for float weights. Results match
the module path up to float rounding (reduction order in the norms, FMA contraction).

`FusedDecode` is the model runner's entry (worker/model_runner.py; the model file never asks which
kernel runs). `DecodeStack.for_step` returns the stack when a step can take it, None otherwise
(the runner then runs the model's modules): CPU float32 or bfloat16 (activations, norms and KV
cache of one dtype), a decode-only step of at most MAX_ROWS tokens (SMALL_BATCH for packed weights
on float32 rows where the quantized kernel's float32 tiles are not built), tensor parallel size 1,
the CPU attention backend with the C++ kernels built, every layer's MLP SiLU-gated, plain RMSNorm,
plain RoPE over the whole head, one sliding window (or none) for every layer, no attention sinks,
one KV cache group. Layers it cannot run (Qwen3's q/k norm, Gemma 3, Phi-3's LongRoPE, gpt-oss,
MLA) are refused, never run wrong. In bfloat16 the elementwise steps round where torch's bfloat16
ops round, and a packed weight multiplies more than BF16_SMALL_BATCH rows through its bfloat16
tiles, as the module path does; in float32, more than SMALL_BATCH rows through its float32 tiles,
or from INT8_FLOAT32_BATCH rows on int8 activations where the weight takes them (the AVX2
path's batched decode: PackedLinearWeight.matmul's choice, made the same way here).
LLMCTL_FUSED_DECODE=0 turns it off. The extension is compiled with the other CPU kernels at
set-up (`python -m llmctl.engine.kernels.cpu.cpu_kernels`), else on first use.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from llmctl.engine import envs
from llmctl.engine.forward_context import get_attn_metadata

logger = logging.getLogger("llmctl")

_SOURCE = tuple(
    Path(__file__).with_name(name)
    for name in ("fused_decode_cpu.cpp", "layer_ops_cpu.cpp", "layer_ops_cpu.h")
)
_PREFIX = "llmctl_fused_decode"
_EMPTY = torch.empty(0)
# Decode steps of up to this many sequences run in one call: with bfloat16 tiles (or float
# weights) the stack's matmuls are the module path's at any batch, and at 64 sequences its one
# call saves the module path's ~1200 ops a step. float32 rows on packed weights: the same, on
# their float32 tiles (or int8 activations) above SMALL_BATCH rows.
MAX_ROWS = 256


def enabled() -> bool:
    return envs.LLMCTL_FUSED_DECODE


class DecodeStack:
    """The C++ stack of `layers` (LlamaDecoderLayer), rebuilt when the KV caches are rebound."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        ops: list[str],
        tile_from: int,
        f32_tile_from: int = 0,
        int8_from: int = 0,
    ):
        _remember_caches(self, layers)
        tensors, meta = _flatten(layers, tile_from, f32_tile_from, int8_from)
        attn = layers[0].self_attn.attn
        eps = layers[0].input_layernorm.variance_epsilon
        namespace = getattr(torch.classes, _namespace())
        self.stack = namespace.DecodeStack(tensors, meta, float(eps), float(attn.scale), ops)
        self.sliding_window = attn.sliding_window  # every layer's (_ops_for checked)
        from llmctl.engine.kernels.cpu.quantized_matmul import SMALL_BATCH

        # Float weights (oneDNN) and the tiles take any batch; without tiles, packed weights on
        # float32 rows only their decode kernel, which beats the tiles up to SMALL_BATCH rows.
        quantized = any(
            p.bits > 0 for layer in layers for lin in _linears(layer) for p in _parts(lin)
        )
        tiles = tile_from or f32_tile_from
        self.max_rows = SMALL_BATCH if quantized and not tiles else MAX_ROWS

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
            self.sliding_window,
            final_norm,
        )

    @staticmethod
    def for_step(owner: nn.Module, layers: Sequence[nn.Module], num_tokens: int):
        """`owner`'s stack for this step's `layers`, or None when the step cannot take it."""
        if not layers or num_tokens > MAX_ROWS:
            return None
        md = get_attn_metadata()
        if md is None or md.prefills or md.num_decodes != num_tokens:
            return None
        stack = owner.__dict__.get("_fused_decode_stack")
        if stack is not None and stack.current(layers):
            fits = isinstance(stack, DecodeStack) and num_tokens <= stack.max_rows
            return stack if fits else None
        # Decided again whenever the KV caches are rebound (a step before they are bound is no
        # reason to give up the stack for good).
        ops = _ops_for(layers)
        stack = DecodeStack(layers, *ops) if ops is not None else _NoStack(layers)
        owner.__dict__["_fused_decode_stack"] = stack
        fits = isinstance(stack, DecodeStack) and num_tokens <= stack.max_rows
        return stack if fits else None


class FusedDecode:
    """The model runner's CPU path for small decode steps of a Llama-family pipeline stage: what
    LlamaModel.forward computes (embedding or the previous stage's tensors, the layers, the last
    stage's final RMSNorm), with the layers in one DecodeStack call. The runner builds one when
    its attention backend runs the C++ decode kernel and the model has Llama's stage layout;
    `__call__` returns None for a step the stack cannot take (the runner then runs the model)."""

    def __init__(self, inner: nn.Module):
        self.inner = inner  # the LlamaModel: its stack is cached on it

    @classmethod
    def for_model(cls, model: nn.Module, backend) -> FusedDecode | None:
        inner = getattr(model, "model", None)
        if not (backend.runs_cpu_decode_kernel and hasattr(inner, "stage_layers")):
            return None
        return cls(inner)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate):
        inner = self.inner
        layers = inner.stage_layers()
        stack = DecodeStack.for_step(inner, layers, input_ids.shape[0])
        if stack is None:
            return None
        if inner.shard.is_first:
            hidden, residual = inner.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        final = _final_norm(inner, layers)
        hidden, residual = stack(hidden, residual, positions, final)
        if final is not None:
            return hidden
        if not inner.shard.is_last:
            return {"hidden_states": hidden, "residual": residual}
        return inner.norm(hidden, residual)[0]


def _final_norm(inner: nn.Module, layers: Sequence[nn.Module]) -> torch.Tensor | None:
    """The last stage's final RMSNorm weight when the C++ stack can apply it in the same call (a
    plain RMSNorm of the layers' dtype and epsilon), else None."""
    from llmctl.engine.layers.layernorm import RMSNorm

    norm = inner.norm if inner.shard.is_last else None
    first = layers[0].input_layernorm
    if (
        type(norm) is RMSNorm
        and norm.weight.dtype == first.weight.dtype
        and norm.variance_epsilon == first.variance_epsilon
    ):
        return norm.weight
    return None


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


def _ops_for(layers: Sequence[nn.Module]) -> tuple[list[str], int, int, int] | None:
    """The kernels' op names, the bfloat16 rows above which packed weights run their bfloat16
    tiles, the float32 rows above which their float32 tiles, and the float32 rows from which
    int8 activations (0: never), when `layers` can run fused, else None (said once, at debug)."""
    from llmctl.engine.distributed.parallel_state import get_tp_group
    from llmctl.engine.kernels.cpu import paged_attention_cpu
    from llmctl.engine.kernels.cpu import quantized_matmul as kernels

    reason = None
    if not enabled():
        reason = "LLMCTL_FUSED_DECODE=0"
    elif get_tp_group().world_size != 1:
        reason = "tensor parallel"
    elif not all(_on_cpu_kernel(layer) for layer in layers):
        reason = "an attention backend other than the CPU's"
    elif not all(_fusable(layer) for layer in layers):
        reason = "a layer that is not a float32/bfloat16 SiLU-gated Llama layer, plain attention"
    elif len({layer.self_attn.attn.sliding_window for layer in layers}) > 1:
        reason = "layers with different sliding windows"
    elif _namespace() is None or paged_attention_cpu._kernel() is None:
        reason = "a CPU kernel is not built"
    if reason is not None:
        logger.debug("fused decode off: %s", reason)
        return None
    quantized = kernels._kernel()
    attention = paged_attention_cpu._kernel()
    int4 = int8 = tiled = int8_act = ""
    if quantized is not None:
        int4 = quantized.int4_group_mm._qualified_op_name
        int8 = quantized.int8_group_mm._qualified_op_name
        tiled = quantized.tiled_group_mm._qualified_op_name
        if kernels.float32_int8(quantized):
            int8_act = quantized.int4_group_mm_int8_act._qualified_op_name
    needs_int = any(
        part.bits > 0 for layer in layers for lin in _linears(layer) for part in _parts(lin)
    )
    if needs_int and not int4:
        logger.debug("fused decode off: the quantized matmul kernel is not built")
        return None
    bf16 = layers[0].input_layernorm.weight.dtype == torch.bfloat16
    tile_from = kernels.BF16_SMALL_BATCH if bf16 and kernels._bf16_tiles() else 0
    f32_tile_from = kernels.SMALL_BATCH if not bf16 and tiled else 0
    int8_from = kernels.INT8_FLOAT32_BATCH if f32_tile_from and int8_act else 0
    ops = [int4, int8, tiled, int8_act, attention._qualified_op_name]
    return ops, tile_from, f32_tile_from, int8_from


def _on_cpu_kernel(layer: nn.Module) -> bool:
    backend = layer.self_attn.attn.backend
    return backend is not None and backend.runs_cpu_decode_kernel


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


class _Part:
    def __init__(
        self, bits: int, group: int, q: torch.Tensor, scales=None, zeros=None, packed=None
    ):
        self.bits, self.group, self.q = bits, group, q
        self.scales = _EMPTY if scales is None else scales
        self.zeros = _EMPTY if zeros is None else zeros
        self.packed = packed  # the PackedLinearWeight, where it is one


def _parts(linear: nn.Module) -> list[_Part]:
    method = linear.quant_method
    if method is None:
        if linear._packed is not None:  # oneDNN's prepacked copy (linear.py)
            return [_Part(-1, 0, linear._packed)]
        return [_Part(0, 0, linear.weight)]
    parts = []
    for p in method.parts:
        if hasattr(p, "qweight"):  # PackedLinearWeight
            parts.append(_Part(p.bits, p.group_size, p.qweight, p.scales, p.zeros, p))
        else:  # _FloatRows
            parts.append(_Part(0, 0, p.weight))
    return parts


def _fusable(layer: nn.Module) -> bool:
    from llmctl.engine.layers.activation import SiluAndMul
    from llmctl.engine.layers.layernorm import RMSNorm

    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    if attn is None or not isinstance(getattr(mlp, "act_fn", None), SiluAndMul):
        return False  # not a dense Llama layer (a mixture of experts, GPT-2, OPT)
    norms = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    if any(type(norm) is not RMSNorm for norm in norms) or not hasattr(attn, "qkv_proj"):
        return False  # Gemma's (1 + weight) norms; MLA's projections
    if getattr(attn, "qk_norm", False):  # Qwen3's per-head q/k norm: not in the C++ layer
        return False
    inner = getattr(attn, "attn", None)
    if inner is None or inner.sinks is not None or inner.kv_cache_group != 0:
        return False  # gpt-oss's sinks; a model with several KV cache groups
    if not getattr(attn.rotary_emb, "plain", False):  # LongRoPE, partial rotary
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
    if attn.rotary_emb.rotary_dim != attn.head_dim or attn.rotary_emb.interleaved:
        return False  # partial or interleaved rotary (GLM-4.5, DeepSeek): not in the C++ layer
    for linear in _linears(layer):
        if linear.quant_method is None and linear.weight.dtype != dtype:
            return False
        if linear.quant_method is not None and any(
            type(p).__name__ == "Fp8LinearWeight" for p in linear.quant_method.parts
        ):
            return False  # block FP8: the C++ stack's matmuls are the integer formats
        for part in _parts(linear):
            if part.bits == 0 and part.q.dtype != dtype:
                return False
    return True


def _flatten(
    layers: Sequence[nn.Module], tile_from: int, f32_tile_from: int = 0, int8_from: int = 0
) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors and integers DecodeStack's constructor reads (see fused_decode_cpu.cpp)."""
    from llmctl.engine.kernels.cpu import quantized_matmul as kernels

    first = layers[0].self_attn
    rotary = first.rotary_emb
    tensors: list[torch.Tensor] = [rotary.cos_cache, rotary.sin_cache]
    attn = first.attn
    meta = [len(layers), attn.num_heads, attn.num_kv_heads, first.head_dim, tile_from]
    meta += [f32_tile_from, int8_from]
    threads, op = torch.get_num_threads(), kernels._kernel() if int8_from else None
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
            for part in parts:  # tiles of W: the rows the Python path takes
                n, packed = part.q.shape[0], part.packed
                rows = kernels.bf16_tile_rows(n, threads) if part.bits > 0 else 0
                f32_rows = 0
                if part.bits > 0 and packed is not None:
                    f32_rows = kernels.float32_tile_rows(n, packed.in_features, threads)
                int8_act = op is not None and packed is not None and packed._takes_int8_act(op)
                meta += [part.bits, part.group, rows, f32_rows, int(int8_act)]
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
