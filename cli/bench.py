"""`llmctl bench throughput|latency|serve`: vLLM's three benchmarks, and the device's limit.

Each command parses its flags (the workload's from the benchmark's args dataclass, the engine's
as `generate` takes them), calls engine/benchmarks/, prints the result as a table and, with
--output-json, writes it under vLLM's key names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from llmctl.cli.console import CliState, stdout_console
from llmctl.cli.engine_options import EngineKwargs, Model, engine_options
from llmctl.engine.benchmarks.latency import BENCH_LATENCY, LatencyArgs
from llmctl.engine.benchmarks.serve import BENCH_SERVE, ServeArgs
from llmctl.engine.benchmarks.throughput import BENCH_THROUGHPUT, ThroughputArgs

app = typer.Typer(
    name="bench",
    help="Benchmark the engine as vLLM's `vllm bench` does: offline throughput, the latency of "
    "one batch, or a running server; each reports the fraction of the device's limit it reached.",
    no_args_is_help=True,
)

OutputJson = Annotated[
    Path | None,
    typer.Option("--output-json", help="Write the results to this JSON file (vLLM's keys)."),
]


@app.command()
@engine_options("generate")
@engine_options(BENCH_THROUGHPUT, param="bench", args_class=ThroughputArgs)
def throughput(
    ctx: typer.Context,
    model: Model = None,
    bench: dict = None,  # ThroughputArgs' options
    engine: EngineKwargs = None,  # the engine options, as `generate` takes them
    output_json: OutputJson = None,
) -> None:
    """Offline throughput: every prompt at once through the engine (try --load-format dummy)."""
    from llmctl.engine.benchmarks.throughput import run_throughput

    state: CliState = ctx.obj or CliState()
    result = run_throughput({"model": model, **engine}, ThroughputArgs(**bench), state.progress)
    rows = [
        ("Requests", f"{result['num_requests']}"),
        ("Elapsed", f"{result['elapsed_time']:.2f} s"),
        ("Requests/s", f"{result['requests_per_second']:.2f}"),
        ("Total tokens/s", f"{result['tokens_per_second']:.1f}"),
        ("Output tokens/s", f"{result['output_tokens_per_second']:.1f}"),
    ]
    _finish("Throughput", rows + _limit_rows(result), result, output_json)


@app.command()
@engine_options("generate")
@engine_options(BENCH_LATENCY, param="bench", args_class=LatencyArgs)
def latency(
    ctx: typer.Context,
    model: Model = None,
    bench: dict = None,  # LatencyArgs' options
    engine: EngineKwargs = None,
    output_json: OutputJson = None,
) -> None:
    """The latency of one batch, end to end; its decode and prefill against the device's limit."""
    from llmctl.engine.benchmarks.latency import run_latency
    from llmctl.engine.progress import rich_progress

    state: CliState = ctx.obj or CliState()
    args = LatencyArgs(**bench)
    if state.progress:
        with rich_progress() as progress:
            result = run_latency({"model": model, **engine}, args, progress)
    else:
        result = run_latency({"model": model, **engine}, args, None)
    rows = [("Avg latency", f"{result['avg_latency']:.4f} s")]
    rows += [(f"p{p} latency", f"{v:.4f} s") for p, v in result["percentiles"].items()]
    rows.append(("Avg prefill latency", f"{result['avg_prefill_latency']:.4f} s"))
    decode = result.get("decode")
    if decode:
        rows += [
            ("Decode", f"{decode['ms_per_step']:.2f} ms/step"),
            (
                "Decode bandwidth",
                f"{decode['achieved_bandwidth'] / 1e9:.1f} GB/s = "
                f"{100 * decode['fraction_of_bandwidth']:.1f}% of the limit",
            ),
        ]
    prefill = result["prefill"]
    rows.append(
        (
            "Prefill",
            f"{prefill['achieved_flops_per_s'] / 1e12:.2f} TFLOP/s = "
            f"{100 * prefill['fraction_of_peak']:.1f}% of the peak",
        )
    )
    _finish("Latency", rows + _limit_rows(result), result, output_json)


@app.command()
@engine_options(BENCH_SERVE, param="bench", args_class=ServeArgs)
def serve(
    ctx: typer.Context,
    bench: dict = None,  # ServeArgs' options
    output_json: OutputJson = None,
) -> None:
    """Online serving against a running OpenAI-compatible server: TTFT, TPOT, ITL, E2E."""
    from llmctl.engine import envs
    from llmctl.engine.benchmarks.serve import run_serve
    from llmctl.engine.progress import rich_progress

    state: CliState = ctx.obj or CliState()
    args = ServeArgs(**bench, api_key=envs.LLMCTL_API_KEY)
    if state.progress:
        with rich_progress() as progress:
            result = run_serve(args, lambda done, total: progress(done, total, "Requests"))
    else:
        result = run_serve(args)
    rows = [
        ("Successful requests", f"{result['completed']} of {result['num_prompts']}"),
        ("Duration", f"{result['duration']:.2f} s"),
        ("Request throughput", f"{result['request_throughput']:.2f} req/s"),
        ("Output token throughput", f"{result['output_throughput']:.1f} tok/s"),
        ("Total token throughput", f"{result['total_token_throughput']:.1f} tok/s"),
    ]
    for metric in args.metrics():
        rows.append((f"Mean {metric.upper()}", f"{result[f'mean_{metric}_ms']:.2f} ms"))
        rows += [
            (f"P{p:g} {metric.upper()}", f"{result[f'p{p:g}_{metric}_ms']:.2f} ms")
            for p in args.percentiles()
        ]
    _finish("Serving", rows, result, output_json)


def _limit_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    limit = result["device_limit"]
    return [
        (
            "Device limit",
            f"{limit['device']}: {limit['bandwidth'] / 1e9:.0f} GB/s, "
            f"{limit['peak_flops'] / 1e12:.1f} TFLOP/s {limit['dtype']} ({limit['source']})",
        ),
        ("Fraction of the limit", f"{100 * result['fraction_of_limit']:.1f}%"),
    ]


def _finish(title: str, rows: list[tuple[str, str]], result: dict, output_json: Path | None):
    table = Table(title=f"{title} benchmark", show_header=False)
    for name, value in rows:
        table.add_row(name, value)
    stdout_console().print(table)
    if output_json is not None:
        output_json.write_text(json.dumps(result, indent=2) + "\n")
