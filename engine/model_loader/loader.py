"""Build a model for this rank and fill it from the checkpoint through the layers' loaders."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llmctl.engine.config.engine_config import ModelConfig
from llmctl.engine.distributed.partition import PipelineShard
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.quantization.linear_method import set_quant_config
from llmctl.engine.model_loader.dummy import initialize_dummy_weights
from llmctl.engine.model_loader.weights import count_weights, iterate_weights
from llmctl.engine.models.registry import get_model_class
from llmctl.engine.platform import torch_dtype

ProgressFn = Callable[[int, int, str], None]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def local_weights_path(model_config: ModelConfig) -> str:
    """The weights' directory on this node. The driver resolved the model on its own node; a
    rank on another node (Ray) resolves it again here, so a GGUF file is converted on this node's
    disk (the model path itself is the same on every node)."""
    if os.path.isdir(model_config.path):
        return model_config.path
    from llmctl.engine.model_loader.source import resolve_model

    return resolve_model(model_config.model or None).path


def local_gguf_path(model_config: ModelConfig) -> str:
    """The GGUF file on this node (the same path on every node, resolved again on a node that
    lacks it as the driver named it)."""
    if os.path.isfile(model_config.gguf_file):
        return model_config.gguf_file
    from llmctl.engine.model_loader.source import resolve_model

    return resolve_model(model_config.model or None).gguf_file or model_config.gguf_file


def _checkpoint(model_config: ModelConfig) -> tuple[Iterator, int, str]:
    """(name, tensor) pairs of the checkpoint, their count, and where they come from."""
    if model_config.gguf_file:
        from llmctl.engine.model_loader.gguf_file import (
            gguf_architecture,
            gguf_tensor_count,
            iterate_gguf_weights,
        )

        path = local_gguf_path(model_config)
        quant = model_config.quantization
        shape = model_config.shape
        weights = iterate_gguf_weights(
            path,
            gguf_architecture(path),
            shape.num_attention_heads,
            shape.num_kv_heads,
            # The float path (no quantization, or int8/int4 of the dequantized file).
            dequantize=quant is None or quant.method != "gguf",
        )
        return weights, gguf_tensor_count(path), path
    path = local_weights_path(model_config)
    weights = iterate_weights(path)
    quant = model_config.quantization
    if quant is not None and quant.checkpoint_fp8:  # each FP8 weight joined to its scales
        from llmctl.engine.model_loader.fp8_checkpoint import pair_fp8_scales

        weights = pair_fp8_scales(weights, quant.weight_block_size)
    return weights, count_weights(path), path


def load_model(
    model_config: ModelConfig,
    shard: PipelineShard,
    device: str,
    progress: ProgressFn | None = None,
) -> nn.Module:
    model_class = get_model_class(model_config.architecture)
    with (
        torch.device(device),
        _default_dtype(torch_dtype(model_config.dtype)),
        set_quant_config(model_config.quantization),
    ):
        model = model_class(model_config.hf_config, model_config.shape, shard)
    if model_config.quantization is not None and device == "cpu":  # (dummy int8/int4 too)
        from llmctl.engine.kernels.cpu.quantized_matmul import build_in_background

        build_in_background()  # a first run's kernel compile overlaps with reading the weights
        if model_config.quantization.method == "fp8":
            from llmctl.engine.kernels.cpu.fp8_matmul import kernel_available

            kernel_available()  # built (or found) before the first matmul's timing
    from llmctl.engine.kernels.cpu.quantized_matmul import int8_activations

    # packed weights made while loading take int8 activations where the config says so
    int8 = model_config.int8_activations and device == "cpu"
    with (
        torch.device(device),
        _default_dtype(torch_dtype(model_config.dtype)),
        int8_activations(int8),
    ):
        if model_config.load_format == "dummy":
            initialize_dummy_weights(model, model_config.seed)
        else:
            _load_checkpoint(model, model_config, progress)
    unique = {id(p): p for p in model.parameters()}.values()
    # What this rank holds, before CPU repacking replaces some weights by packed copies.
    model.loaded_weight_bytes = sum(p.numel() * p.element_size() for p in unique)
    with int8_activations(int8):
        for module in model.modules():
            process = getattr(module, "process_weights_after_loading", None)
            if process is not None:
                process()
    # Quantized weights are not parameters: count what their packed form holds.
    packed = {}
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            packed[id(module)] = module.quant_method.nbytes
        elif getattr(module, "packed", None) is not None:  # a quantized embedding / LM head
            packed[id(module.packed)] = module.packed.nbytes
    model.loaded_weight_bytes += sum(packed.values())
    return model.eval()


def _load_checkpoint(model: nn.Module, model_config: ModelConfig, progress) -> None:
    weights, total, path = _checkpoint(model_config)
    if progress is not None:
        weights = _with_progress(weights, total, progress)
    loaded = model.load_weights(weights)
    _check_all_loaded(model, loaded, path)


def _with_progress(
    weights: Iterator[tuple[str, CheckpointTensor]], total: int, progress: ProgressFn
) -> Iterator[tuple[str, CheckpointTensor]]:
    for i, item in enumerate(weights, 1):
        yield item
        progress(i, total, "loading weights")


def _check_all_loaded(model: nn.Module, loaded: set[str], path: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[name]) for name in loaded if name in params}
    missing = sorted(name for name, p in params.items() if id(p) not in loaded_ids)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(
            f"the checkpoint in {path} lacks {len(missing)} weights the model needs: {shown}",
            "the weight files are incomplete or belong to another model; copy them again",
        )
