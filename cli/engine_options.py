"""Engine options shared by the commands that start an engine (`generate`, `serve`).

Each option is defined once here, under vLLM's name, as a typed alias a command uses as a
parameter annotation; `engine_kwargs` turns the given ones into EngineArgs keywords.
"""

from __future__ import annotations

from typing import Annotated

import typer

ENGINE = "Engine"
PARALLEL = "Parallelism"


Dtype = Annotated[
    str,
    typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=ENGINE),
]

MaxModelLen = Annotated[
    int | None,
    typer.Option(
        help="Longest prompt + completion, in tokens. (default: the model's)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

KvCacheSpaceGib = Annotated[
    float | None,
    typer.Option(
        help="CPU: memory for the KV cache, in GiB. (default: 4)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

GpuMemoryUtilization = Annotated[
    float | None,
    typer.Option(
        help="CUDA: fraction of each GPU's memory the engine may use (weights, activations, KV "
        "cache: the KV cache gets what the others leave). (default: 0.9)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

Device = Annotated[
    str | None,
    typer.Option(
        help="auto, cuda or cpu. (default: auto: cuda when torch sees a GPU, else cpu)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

EnforceEager = Annotated[
    bool | None,
    typer.Option(
        "--enforce-eager",
        help="CUDA: run every step eagerly, without CUDA graphs (slower decode, less memory, "
        "no capture at start-up). The CPU always runs eagerly.",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

BlockSize = Annotated[
    int | None,
    typer.Option(
        help="Tokens per KV cache block. (default: 16)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

MaxNumSeqs = Annotated[
    int | None,
    typer.Option(
        help="Most requests per step. (default: 256)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

MaxNumBatchedTokens = Annotated[
    int | None,
    typer.Option(
        help="Most tokens per step (longer prompts prefill in chunks). "
        "(default: 8192, or --max-num-seqs if larger)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

EnablePrefixCaching = Annotated[
    bool | None,
    typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV cache of shared prompt prefixes. (default: enabled)",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

SkipTokenizerInit = Annotated[
    bool | None,
    typer.Option(
        "--skip-tokenizer-init",
        help="Load no tokenizer (the model directory needs no tokenizer files): prompts must be "
        "token ids, outputs carry token ids and no text, stop strings and chat are refused.",
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]

TensorParallelSize = Annotated[
    int | None,
    typer.Option(
        "--tensor-parallel-size",
        "-tp",
        help="Ranks that split each layer (Megatron-LM tensor parallelism). (default: 1)",
        show_default=False,
        rich_help_panel=PARALLEL,
    ),
]

PipelineParallelSize = Annotated[
    int | None,
    typer.Option(
        "--pipeline-parallel-size",
        "-pp",
        help="Pipeline stages that split the layers. (default: 1)",
        show_default=False,
        rich_help_panel=PARALLEL,
    ),
]

DistributedExecutorBackend = Annotated[
    str | None,
    typer.Option(
        "--distributed-executor-backend",
        help="uni, mp or ray. (default: mp when this node has a device per rank, else ray; "
        "on the CPU, devices are LLMCTL_CPU_DEVICES or the cores)",
        show_default=False,
        rich_help_panel=PARALLEL,
    ),
]

PipelineLayerPartition = Annotated[
    str | None,
    typer.Option(
        "--pipeline-layer-partition",
        help='Layers per pipeline stage, e.g. "10,11,9". (default: equal shares, the '
        "remainder before the last stage)",
        show_default=False,
        rich_help_panel=PARALLEL,
    ),
]

Model = Annotated[
    str | None,
    typer.Argument(
        help="A Hugging Face model directory, a .gguf file, or a hub id already in the local "
        "Hugging Face cache. Omitted: the bundled SmolLM2-135M-Instruct.",
        metavar="MODEL",
        show_default=False,
    ),
]


# The EngineArgs options above, as parameters of a command (each command declares them).
ENGINE_OPTIONS = (
    "dtype",
    "max_model_len",
    "kv_cache_space_gib",
    "gpu_memory_utilization",
    "device",
    "enforce_eager",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "skip_tokenizer_init",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "distributed_executor_backend",
    "pipeline_layer_partition",
)


def engine_kwargs(parameters: dict) -> dict:
    """EngineArgs keywords from a command's parameters (its `locals()`): the engine options the
    user gave; None leaves the engine's default."""
    return {name: parameters[name] for name in ENGINE_OPTIONS if parameters.get(name) is not None}
