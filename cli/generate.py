"""`llmctl generate`: offline generation with the bundled engine, under vLLM's option names.

Parse the options into SamplingParams and EngineArgs keywords, call LLM.generate (or LLM.chat),
render the completions. The engine (and with it torch) is imported only when the command runs.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.console import CliState, stdout_console
from llmctl.cli.engine_options import EngineKwargs, Model, engine_options
from llmctl.cli.render import print_completions, print_json
from llmctl.engine.errors import RequestBatchError
from llmctl.engine.sampling_params import SamplingParams

app = typer.Typer()

_SAMPLING = "Sampling"


@app.command()
@engine_options("generate")
def generate(
    ctx: typer.Context,
    prompt: Annotated[
        list[str],
        typer.Option("--prompt", "-p", help="Prompt text; repeat the option for a batch."),
    ],
    model: Model = None,
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
    engine: EngineKwargs = None,  # the EngineArgs options of `generate` (@engine_options)
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
    from llmctl.engine.entrypoints.llm import LLM

    render = print_json if json_output else print_completions
    console = stdout_console()
    with LLM(model, use_tqdm_on_load=state.progress, **engine) as llm:
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
