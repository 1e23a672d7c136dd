"""`llmctl generate`: offline generation with the bundled engine, under vLLM's option names.

Parse the options into SamplingParams and EngineArgs keywords, call LLM.generate (or LLM.chat),
render the completions. The engine (and with it torch) is imported only when the command runs.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.console import CliState, stdout_console
from llmctl.cli.render import print_completions, print_json
from llmctl.engine.errors import RequestBatchError
from llmctl.engine.sampling_params import SamplingParams

app = typer.Typer()

_SAMPLING = "Sampling"
_ENGINE = "Engine"
_PARALLEL = "Parallelism"


@app.command()
def generate(
    ctx: typer.Context,
    prompt: Annotated[
        list[str],
        typer.Option("--prompt", "-p", help="Prompt text; repeat the option for a batch."),
    ],
    model: Annotated[
        str | None,
        typer.Argument(
            help="A Hugging Face model directory, a .gguf file, or a hub id already in the local "
            "Hugging Face cache. Omitted: the bundled SmolLM2-135M-Instruct.",
            metavar="MODEL",
            show_default=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(help="Most tokens to generate per completion.", rich_help_panel=_SAMPLING)
    ] = 64,
    temperature: Annotated[
        float,
        typer.Option(
            help="0 is greedy decoding, deterministic (the default here; vLLM and the OpenAI API "
            "default to 1.0). Higher values sample more freely.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 0.0,
    top_p: Annotated[
        float,
        typer.Option(
            help="Nucleus sampling: keep the most likely tokens up to this mass.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 1.0,
    top_k: Annotated[
        int,
        typer.Option(
            help="Keep the k most likely tokens; 0 or -1 keeps all.", rich_help_panel=_SAMPLING
        ),
    ] = 0,
    min_p: Annotated[
        float,
        typer.Option(
            help="Drop tokens less likely than min_p times the most likely one.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 0.0,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of each request's sampler: the same seed gives the same text.",
            rich_help_panel=_SAMPLING,
        ),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            help="Stop at this string (not included in the text); repeatable.",
            rich_help_panel=_SAMPLING,
        ),
    ] = None,
    n: Annotated[
        int, typer.Option("--n", help="Completions per prompt.", rich_help_panel=_SAMPLING)
    ] = 1,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            help="Keep generating past the end-of-sequence token.", rich_help_panel=_SAMPLING
        ),
    ] = False,
    chat: Annotated[
        bool,
        typer.Option(
            help="Send each prompt as one user message through the chat template.",
            rich_help_panel=_SAMPLING,
        ),
    ] = False,
    dtype: Annotated[
        str,
        typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=_ENGINE),
    ] = "auto",
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="Longest prompt + completion, in tokens. (default: the model's)",
            show_default=False,
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    kv_cache_space_gib: Annotated[
        float | None,
        typer.Option(
            help="CPU: memory for the KV cache, in GiB. (default: 4)",
            show_default=False,
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(
            help="Tokens per KV cache block. (default: 16)",
            show_default=False,
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        typer.Option(
            help="Most requests per step. (default: 256)",
            show_default=False,
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            help="Most tokens per step (longer prompts prefill in chunks). "
            "(default: 8192, or --max-num-seqs if larger)",
            show_default=False,
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    enable_prefix_caching: Annotated[
        bool | None,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Reuse the KV cache of shared prompt prefixes. (default: enabled)",
            show_default=False,
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    tensor_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--tensor-parallel-size",
            "-tp",
            help="Ranks that split each layer (Megatron-LM tensor parallelism). (default: 1)",
            show_default=False,
            rich_help_panel=_PARALLEL,
        ),
    ] = None,
    pipeline_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--pipeline-parallel-size",
            "-pp",
            help="Pipeline stages that split the layers. (default: 1)",
            show_default=False,
            rich_help_panel=_PARALLEL,
        ),
    ] = None,
    distributed_executor_backend: Annotated[
        str | None,
        typer.Option(
            "--distributed-executor-backend",
            help="uni, mp or ray. (default: mp when this node has a device per rank, else ray; "
            "on the CPU, devices are LLMCTL_CPU_DEVICES or the cores)",
            show_default=False,
            rich_help_panel=_PARALLEL,
        ),
    ] = None,
    pipeline_layer_partition: Annotated[
        str | None,
        typer.Option(
            "--pipeline-layer-partition",
            help='Layers per pipeline stage, e.g. "10,11,9". (default: equal shares, the '
            "remainder before the last stage)",
            show_default=False,
            rich_help_panel=_PARALLEL,
        ),
    ] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print a JSON list of {prompt, index, text, token_ids, "
            "finish_reason}, one object per completion.",
        ),
    ] = False,
) -> None:
    """Generate completions for one prompt or a batch, with the bundled engine.

    Prints each prompt, then its completion(s). Engine log lines and progress bars go to stderr.
    """
    state: CliState = ctx.obj or CliState()
    params = SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        stop=stop or None,
        ignore_eos=ignore_eos,
        seed=seed,
    )
    engine_kwargs = {
        "dtype": dtype,
        "max_model_len": max_model_len,
        "kv_cache_space_gib": kv_cache_space_gib,
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_prefix_caching": enable_prefix_caching,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "distributed_executor_backend": distributed_executor_backend,
        "pipeline_layer_partition": pipeline_layer_partition,
    }
    engine_kwargs = {name: value for name, value in engine_kwargs.items() if value is not None}

    from llmctl.engine.llm import LLM

    render = print_json if json_output else print_completions
    console = stdout_console()
    with LLM(model, use_tqdm_on_load=state.progress, **engine_kwargs) as llm:
        try:
            if chat:
                conversations = [[{"role": "user", "content": text}] for text in prompt]
                outputs = llm.chat(conversations, params, use_tqdm=state.progress)
            else:
                outputs = llm.generate(prompt, params, use_tqdm=state.progress)
        except RequestBatchError as exc:
            render(console, prompt, exc.outputs)  # the prompts that were valid still ran
            raise
    render(console, prompt, outputs)
