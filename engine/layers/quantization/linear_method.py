"""The quantized linear method (vLLM's `quant_method`): a linear layer's weights kept packed.

The model's QuantizationConfig is current while its layers are built (`set_quant_config`, as
vLLM's current config); a linear layer built under one gets a PackedLinearMethod, which
- takes the rows this rank's weight loader narrowed (a GGUF QuantizedCheckpointTensor, decoded
  to q/scales/zeros; or float rows, quantized round-to-nearest for int8/int4), so each rank reads
  and packs only its slice; fused layers (QKV, gate/up) store each sub-matrix at its row offset;
- packs them after loading (`quantized_matmul.pack_groups`); sub-matrices of different formats (a
  Q4_K_M file's Q6_K attn_v next to Q4_K q/k) stay separate packed weights, concatenated on output;
- computes y = x W^T (+ b) with `packed.matmul`. Activations stay float.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from llmctl.engine.errors import ConfigError, ModelLoadError
from llmctl.engine.kernels.cpu.quantized_matmul import PackedLinearWeight, pack_groups
from llmctl.engine.layers.quantization.quant_config import QuantizationConfig

_current: QuantizationConfig | None = None


@contextlib.contextmanager
def set_quant_config(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers built inside read `config` with `current_quant_config()`."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def current_quant_config() -> QuantizationConfig | None:
    return _current


@contextlib.contextmanager
def router_quant_config() -> Iterator[None]:
    """Around a mixture of experts' router (and Qwen2-MoE's shared-expert gate): under
    --quantization int8/int4 they stay float, as vLLM builds its gates without a quant_config
    (a few thousand weights whose rounding would change which experts a token meets); a GGUF
    file's router keeps the file's own type."""
    config = _current if _current is not None and _current.method == "gguf" else None
    with set_quant_config(config):
        yield


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int):
    """Round-to-nearest per-group quantization of float rows [N, K] -> (q, scales, zeros).

    int8: symmetric, q in [-127, 127], zeros None. int4: asymmetric, q in [0, 15],
    W ~= q * scale + zero with zero the group's minimum (quantization/rtn.py), with a typed
    error for a layer whose input features are not whole groups."""
    n, k = w.shape
    if k % group_size:
        raise ConfigError(
            f"--quantization int{bits} quantizes groups of {group_size} input features, but a "
            f"layer has {k}",
            "run this model in float (leave out --quantization)",
        )
    from llmctl.engine.layers.quantization.rtn import quantize_rtn as rtn

    return rtn(w, bits, group_size)


def dequantize_groups(q, scales, zeros, group_size: int) -> torch.Tensor:
    """float32 W = q * scales + zeros, groups along the last dimension (the packing contract)."""
    w = q.float() * scales.float().repeat_interleave(group_size, dim=-1)
    if zeros is not None:
        w += zeros.float().repeat_interleave(group_size, dim=-1)
    return w


class _FloatRows:
    """Rows a quantized layer holds in float (a GGUF file's F16/F32 tensor)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class PackedLinearMethod:
    def __init__(self, config: QuantizationConfig):
        self.config = config
        self._pieces: list[tuple[int, tuple]] = []  # (first row, decoded rows)
        self.parts: list = []  # packed weights, in output order

    def create_weights(self, layer: torch.nn.Module) -> torch.nn.Parameter:
        """The layer's `weight` parameter: an empty placeholder that carries the weight loader;
        the packed weights are not parameters."""
        return torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def store(self, layer: torch.nn.Module, row_start: int, loaded, what: str) -> None:
        """Take rows [row_start, row_start + rows) of this rank's weight."""
        loaded = readable(loaded)
        expected_k = layer.input_size_per_partition
        if loaded.shape[1] != expected_k or row_start + loaded.shape[0] > (
            layer.output_size_per_partition
        ):
            raise ModelLoadError(
                f"{what}: checkpoint shard has shape {tuple(loaded.shape)}, the model expects "
                f"rows within {layer.output_size_per_partition} and {expected_k} columns",
                "the weights do not match config.json; check that both come from the same model",
            )
        self._pieces.append((row_start, decode_piece(self.config, loaded)))
        if sum(_rows(p) for _, p in self._pieces) == layer.output_size_per_partition:
            # Complete: pack now, so that the decoded rows of one layer at a time are in memory.
            self.process_weights_after_loading(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.parts and not self._pieces:
            return  # packed when its last rows arrived
        pieces = sorted(self._pieces, key=lambda p: p[0])
        self._pieces = []
        rows = sum(_rows(p) for _, p in pieces)
        if rows != layer.output_size_per_partition:
            raise ModelLoadError(
                f"{type(layer).__name__}: the checkpoint gave {rows} of its "
                f"{layer.output_size_per_partition} output rows",
                "the weight files are incomplete or belong to another model",
            )
        device = layer.weight.device  # the placeholder was made on the model's device
        self.parts = pack_pieces([piece for _, piece in pieces], device)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if len(self.parts) == 1 and bias is None and x.dim() == 2:
            return self.parts[0].matmul(x)  # the decode path: no reshapes
        x2 = x.reshape(-1, x.shape[-1])  # [num_tokens, K]
        if len(self.parts) == 1:
            out = self.parts[0].matmul(x2)
        else:
            out = torch.cat([p.matmul(x2) for p in self.parts], dim=-1)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def readable(loaded):
    """A checkpoint slice as store() takes it: a torch tensor or a QuantizedCheckpointTensor
    (a lazy float CheckpointTensor is read now)."""
    from llmctl.engine.layers.checkpoint_tensor import QuantizedCheckpointTensor

    if not isinstance(loaded, (torch.Tensor, QuantizedCheckpointTensor)):
        loaded = loaded.load()  # a whole CheckpointTensor (a replicated layer's)
    return loaded


def decode_piece(config: QuantizationConfig, loaded) -> tuple:
    """("packed", PackedLinearWeight) or ("float", tensor) of checkpoint rows: a GGUF
    QuantizedCheckpointTensor decoded as it is, float rows quantized round-to-nearest under
    int8/int4, or kept float (a GGUF file's float tensor)."""
    from llmctl.engine.layers.checkpoint_tensor import QuantizedCheckpointTensor

    loaded = readable(loaded)
    if isinstance(loaded, QuantizedCheckpointTensor):
        return ("packed", loaded.decode())
    if config.bits is not None:
        bits, group = config.bits, config.group_size
        q, scales, zeros = quantize_rtn(loaded, bits, group)
        return ("packed", pack_groups(q, scales, zeros, bits, group))
    return ("float", loaded.to(torch.get_default_dtype()))  # a float tensor in a GGUF file


def pack_pieces(pieces: list[tuple], device: torch.device) -> list:
    """Pieces (decode_piece's) in row order -> the packed weights (or float rows) to multiply
    by, one per run of pieces in one format, concatenated on output."""
    runs: list[list[tuple]] = []
    for piece in pieces:
        if runs and _format(runs[-1][-1]) == _format(piece):
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return [_pack([_to(p, device) for p in run]) for run in runs]


def _rows(piece: tuple) -> int:
    return piece[1].out_features if piece[0] == "packed" else piece[1].shape[0]


def _format(piece: tuple) -> tuple:
    if piece[0] == "float":
        return ("float",)
    w = piece[1]
    return ("packed", w.bits, w.group_size, w.zeros is None)


def _to(piece: tuple, device: torch.device) -> tuple:
    return (piece[0], piece[1].to(device))


def _pack(run: list[tuple]):
    if run[0][0] == "float":
        return _FloatRows(torch.cat([p[1] for p in run]) if len(run) > 1 else run[0][1])
    return PackedLinearWeight.cat([p[1] for p in run])
