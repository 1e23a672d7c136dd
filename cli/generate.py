"""`llmctl generate`: offline generation with the bundled engine, under vLLM's option names.

Parse the options into SamplingParams and EngineArgs keywords, call LLM.generate (or LLM.chat),
render the completions. The engine (and with it torch) is imported only when the command runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated

import typer

from llmctl.cli.console import CliState, stdout_console
from llmctl.cli.engine_options import EngineKwargs, Model, engine_options
from llmctl.cli.render import print_completions, print_json
from llmctl.engine.config.options import option
from llmctl.engine.errors import RequestBatchError
from llmctl.engine.sampling_params import SamplingParams

app = typer.Typer()

_SAMPLING = dict(panel="Sampling", commands=("generate",), show_default=True)


@dataclass(frozen=True)
class SamplingFlags:
    """`generate`'s sampling options: SamplingParams' fields as the command line gives them
    (greedy by default here, where vLLM and the OpenAI API default to temperature 1.0)."""

    max_tokens: int = option("Most tokens to generate per completion.", default=64, **_SAMPLING)
    temperature: float = option(
        "0 is greedy decoding, deterministic (the default here; vLLM and the OpenAI API default "
        "to 1.0). Higher values sample more freely.",
        default=0.0,
        **_SAMPLING,
    )
    top_p: float = option(
        "Nucleus sampling: keep the most likely tokens up to this mass.", default=1.0, **_SAMPLING
    )
    top_k: int = option("Keep the k most likely tokens; 0 or -1 keeps all.", default=0, **_SAMPLING)
    min_p: float = option(
        "Drop tokens less likely than min_p times the most likely one.", default=0.0, **_SAMPLING
    )
    seed: int | None = option(
        "Seed of each request's sampler: the same seed gives the same text.",
        default=None,
        panel="Sampling",
        commands=("generate",),
    )
    stop: list[str] | None = option(
        "Stop at this string (not included in the text); repeatable.",
        default=None,
        panel="Sampling",
        commands=("generate",),
        default_help="",
    )
    n: int = option("Completions per prompt.", default=1, **_SAMPLING)
    ignore_eos: bool = option(
        "Keep generating past the end-of-sequence token.", default=False, **_SAMPLING
    )
    chat: bool = option(
        "Send each prompt as one user message through the chat template.",
        default=False,
        **_SAMPLING,
    )

    def params(self) -> SamplingParams:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["chat"]
        return SamplingParams(**(fields | {"stop": self.stop or None}))


@app.command()
@engine_options("generate")
@engine_options("generate", param="sampling", args_class=SamplingFlags)
def generate(
    ctx: typer.Context,
    prompt: Annotated[
        list[str],
        typer.Option("--prompt", "-p", help="Prompt text; repeat the option for a batch."),
    ],
    model: Model = None,
    sampling: dict = None,  # SamplingFlags' options (@engine_options)
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
    flags = SamplingFlags(**sampling)
    params = flags.params()
    from llmctl.engine.entrypoints.llm import LLM

    render = print_json if json_output else print_completions
    console = stdout_console()
    with LLM(model, use_tqdm_on_load=state.progress, **engine) as llm:
        try:
            if flags.chat:
                conversations = [[{"role": "user", "content": text}] for text in prompt]
                outputs = llm.chat(conversations, params, use_tqdm=state.progress)
            else:
                outputs = llm.generate(prompt, params, use_tqdm=state.progress)
        except RequestBatchError as exc:
            render(console, prompt, exc.outputs)  # the prompts that were valid still ran
            raise
    render(console, prompt, outputs)
