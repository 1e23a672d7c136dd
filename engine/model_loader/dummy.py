"""Dummy weights (vLLM's `--load-format dummy`): random values made on the device, no checkpoint.

A model built from its config.json alone (or a catalog name's) runs its real shape: the same
layers, matmuls, KV cache and kernels as with its checkpoint, so an 8B- or 70B-shaped model can be
timed where its weights are not. Every weight is drawn uniformly from [-1e-3, 1e-3] (vLLM's
range: the activations stay small and finite through any depth) by a generator on the weight's
device, seeded by the engine's seed, in place: nothing crosses the host-device link and no
weight is held twice.

Quantized layers (--quantization int8/int4) get random float rows of their shard, one layer at a
time, which their quant_method packs as it packs a checkpoint's: the packed weights are then in
the layout the kernels read.
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.engine.layers.fused_moe import FusedMoE
from llmctl.engine.layers.linear import LinearBase

LOW, HIGH = -1e-3, 1e-3


def initialize_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` (on its device) with random values in [LOW, HIGH)."""
    draw = _Draw(seed)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.quant_method is not None:
            rows = draw.uniform(
                (module.output_size_per_partition, module.input_size_per_partition),
                module.weight.device,
            )
            module._store(module.weight, 0, rows, f"{type(module).__name__} (dummy)")
        elif isinstance(module, FusedMoE) and module.quant_method is not None:
            _fill_quantized_experts(module, draw)
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen or param.numel() == 0:
            continue  # tied weights once; quantized layers' placeholders hold nothing
        seen.add(id(param))
        draw.fill_(param.data)


def _fill_quantized_experts(moe: FusedMoE, draw: _Draw) -> None:
    inter, hidden = moe.intermediate_size_per_partition, moe.hidden_size
    device = moe.w13_weight.device
    for local in range(moe.num_local_experts):
        for shard_id, shape in (
            ("gate", (inter, hidden)),
            ("up", (inter, hidden)),
            ("down", (hidden, inter)),
        ):
            rows = draw.uniform(shape, device)
            moe.quant_method.store(local, shard_id, rows, shape, device, f"expert {local} (dummy)")


class _Draw:
    """Uniform random tensors from one generator per device."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator | None] = {}

    def uniform(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A new float tensor (the default dtype) of random values."""
        return self.fill_(torch.empty(shape, device=device))

    def fill_(self, tensor: torch.Tensor) -> torch.Tensor:
        device = tensor.device
        if device.type == "meta":
            return tensor  # a shape-only run: no values to draw
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        if tensor.dtype.is_floating_point:
            return tensor.uniform_(LOW, HIGH, generator=self.generators[device])
        return tensor.zero_()
