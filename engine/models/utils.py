"""Pieces every model file shares: pipeline-stage placeholders and the weight-loading loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from torch import nn

from llmctl.engine.distributed.partition import PipelineShard
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor

logger = logging.getLogger("llmctl")

# Keys the stages of a pipeline exchange.
IntermediateTensors = dict


class PPMissingLayer(nn.Identity):
    """Stands in for a layer that lives on another pipeline stage, so that parameter names keep
    their global layer indices on every stage."""


def make_layers(
    num_layers: int, shard: PipelineShard, layer_fn: Callable[[int], nn.Module]
) -> nn.ModuleList:
    return nn.ModuleList(
        layer_fn(i) if shard.start_layer <= i < shard.end_layer else PPMissingLayer()
        for i in range(num_layers)
    )


def layer_index(name: str, marker: str) -> int | None:
    """The layer index in a name such as model.layers.12.mlp.up_proj.weight (marker "layers")."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == marker and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, CheckpointTensor]],
    *,
    stacked: list[tuple[str, str, object]],
    rename: Callable[[str], str | None],
    shard: PipelineShard,
    layer_marker: str,
    transpose: Callable[[str], bool] = lambda name: False,
    experts: Callable[[str], tuple[str, int, str] | None] | None = None,
) -> set[str]:
    """Feed checkpoint tensors to the parameters' weight loaders; return the names loaded.

    `rename` maps a checkpoint name to the model's name (None: skip it). `stacked` lists
    (fused parameter, checkpoint part, shard id), e.g. ("qkv_proj", "q_proj", "q"). `experts`
    maps a MoE expert's tensor to (stacked parameter, expert id, shard id) (fused_moe.
    expert_param); its loader takes both. Tensors of layers on other pipeline stages are
    skipped without being read.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        index = layer_index(name, layer_marker)
        if index is not None and not shard.start_layer <= index < shard.end_layer:
            continue
        if transpose(name):
            tensor = tensor.T
        expert = experts(name) if experts is not None else None
        if expert is not None:
            name, expert_id, shard_id = expert
            param = params.get(name)
            if param is not None:
                param.weight_loader(param, tensor, shard_id, expert_id)
                loaded.add(name)
            continue
        shard_id = None
        for fused, part, sid in stacked:
            if f".{part}." in name:
                name, shard_id = name.replace(f".{part}.", f".{fused}."), sid
                break
        param = params.get(name)
        if param is None:
            logger.debug("checkpoint tensor %s has no parameter on this rank; skipped", ckpt_name)
            continue
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            from llmctl.engine.layers.linear import _copy_into

            _copy_into(param, tensor.load(), name)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    return loaded
