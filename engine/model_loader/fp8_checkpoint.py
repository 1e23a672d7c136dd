"""pair_fp8_scales: a block-FP8 checkpoint's weights joined to their block scales as it is read.

A checkpoint in DeepSeek-V3's format stores `X.weight` in float8_e4m3fn and `X.weight_scale_inv`
beside it (in whichever order, shard or place the files hold them); the layers take the two as
one Fp8CheckpointTensor (layers/fp8_checkpoint_tensor.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.fp8_checkpoint_tensor import Fp8CheckpointTensor

SCALE_SUFFIX = "_scale_inv"


def pair_fp8_scales(
    weights: Iterable[tuple[str, CheckpointTensor]], block: tuple[int, int]
) -> Iterator[tuple[str, CheckpointTensor | Fp8CheckpointTensor]]:
    """The checkpoint's tensors with each FP8 weight joined to its `<name>_scale_inv` (in
    whichever order the files hold them); other tensors pass through. A FP8 weight without
    block scales, or scales without their weight, is a ModelLoadError."""
    waiting_weights: dict[str, CheckpointTensor] = {}
    waiting_scales: dict[str, CheckpointTensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name.removesuffix(SCALE_SUFFIX)
            weight = waiting_weights.pop(weight_name, None)
            if weight is None:
                waiting_scales[weight_name] = tensor
            else:
                yield weight_name, Fp8CheckpointTensor(weight_name, weight, tensor, block)
        elif getattr(tensor, "dtype", None) == torch.float8_e4m3fn:
            scale = waiting_scales.pop(name, None)
            if scale is None:
                waiting_weights[name] = tensor
            else:
                yield name, Fp8CheckpointTensor(name, tensor, scale, block)
        else:
            yield name, tensor
    for name in waiting_weights:
        raise ModelLoadError(
            f"{name} is stored in float8_e4m3fn but the checkpoint has no {name}{SCALE_SUFFIX}",
            "llmctl reads block-FP8 checkpoints (a weight_scale_inv per block, as DeepSeek-V3 "
            "ships them); use a bfloat16 checkpoint with --quantization fp8",
        )
    for name in waiting_scales:
        raise ModelLoadError(
            f"the checkpoint has {name}{SCALE_SUFFIX} but no FP8 weight {name}",
            "the weight files are incomplete; copy them again",
        )
