"""`llmctl plan`: the TP x PP layout for a model on an inventory, its memory and KV cache.

Parse, call `make_plan`, render. Never imports torch: planning is instant.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from llmctl.cli.console import stderr_console, stdout_console
from llmctl.cli.engine_options import EngineKwargs, engine_options
from llmctl.cluster.inventory import INVENTORY_PANEL, InventoryFlags
from llmctl.cluster.plan import manifests as kube_manifests
from llmctl.cluster.plan.kube_options import EmitFlags
from llmctl.engine.errors import ConfigError, LLMCtlError

app = typer.Typer()
_MEMORY = "Memory"


# The options plan shares with the engine, restyled for planning (their flags stay the engine's).
_SHARED = {
    "device": dict(
        help="cuda, or cpu to plan for llmctl's CPU engine (KV cache from --kv-cache-space-gib).",
        panel=INVENTORY_PANEL,
        default="cuda",
    ),
    "kv_cache_space_gib": dict(help="CPU: the KV cache per rank, in GiB.", panel=_MEMORY),
    "tensor_parallel_size": dict(
        help="Evaluate this layout instead of choosing.", panel=None, default_help=""
    ),
    "pipeline_parallel_size": dict(
        help="Evaluate this layout instead of choosing.", panel=None, default_help=""
    ),
    "quantization": dict(
        help="Plan the weights of a float checkpoint quantized: int8 or int4. Without it, a "
        "model too big in float is planned quantized; a GGUF file in its own types.",
        panel=_MEMORY,
        default_help="",
    ),
}


@app.command()
@engine_options("plan", overrides=_SHARED)
@engine_options("plan", param="where", args_class=InventoryFlags)
@engine_options("plan", param="kube", args_class=EmitFlags)
def plan(
    model: Annotated[
        str | None,
        typer.Argument(
            help="A catalog name (see --list-models), a Hugging Face directory or a .gguf file. "
            "Omitted: the bundled SmolLM2-135M-Instruct.",
            metavar="MODEL",
            show_default=False,
        ),
    ] = None,
    list_models: Annotated[
        bool, typer.Option("--list-models", help="Show the built-in catalog and exit.")
    ] = False,
    # The inventory (an -i file, or --nodes ...), then EngineArgs' options of `plan` (restyled by
    # _SHARED): dtype, lengths, memory, quantization, the step's size, the layout and the device.
    where: dict = None,
    allow_uneven_tp: Annotated[
        bool,
        typer.Option(help="Allow tensor parallel sizes that do not divide the heads."),
    ] = False,
    engine: EngineKwargs = None,
    min_concurrency: Annotated[
        int,
        typer.Option(help="Requests of max-model-len the plan must hold.", rich_help_panel=_MEMORY),
    ] = 1,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    kube: dict = None,  # --emit and its options (EmitFlags)
) -> None:
    """Choose the TP x PP layout for MODEL on the inventory and predict its KV-cache capacity.
    Prints the layout, the memory of every GPU, the engine's KV-cache lines, the reasons, the
    layouts rejected and why, and the commands to run. Exits 1 when nothing fits, saying how much
    memory is missing and what would fit.
    """
    from llmctl.cluster.plan.catalog import CATALOG

    console = stdout_console()
    if list_models:
        _print_catalog(console, CATALOG, json_output)
        return
    emit = EmitFlags(**kube)
    if emit.emit is not None and json_output:
        raise ConfigError("--json and --emit both choose what plan prints", "keep one")
    kube_opts = emit.kube_options(model)
    plan_only = dict(min_concurrency=min_concurrency, allow_uneven_tp=allow_uneven_tp)
    try:
        result = _make(model, InventoryFlags(**where), engine, plan_only)
    except LLMCtlError as exc:
        if not json_output:
            raise
        message = exc.message + (f". {exc.hint}" if exc.hint else "")
        console.out(json.dumps({"error": message}), highlight=False)
        raise typer.Exit(1) from None
    if json_output:
        console.out(json.dumps(result.to_json(), indent=2), highlight=False)
    elif kube_opts is not None and emit.output is None:
        _emit(console, result, kube_opts, None)
        _secret_note(stderr_console(), result, kube_opts)  # the YAML alone on stdout
    elif kube_opts is not None:
        wrote = _emit(console, result, kube_opts, emit.output)
        _print_plan(console, result)
        console.print(wrote, highlight=False, soft_wrap=True)
        _secret_note(console, result, kube_opts)
    else:
        _print_plan(console, result)


def _secret_note(console, plan, options) -> None:
    """Pods that join each other read the cluster secret from a Secret: how to make it."""
    if kube_manifests.joins_nodes(plan, options):
        name = kube_manifests.cluster_secret_name(options)
        console.print(
            f"The pods prove the cluster secret in the Secret {name} when they join; make it "
            f"first: {kube_manifests.cluster_secret_command(options)}",
            highlight=False,
            soft_wrap=True,
        )


def _emit(console, plan, options, output: str | None) -> str:
    """The manifests as YAML on stdout, or in `output` (then: the line that says so)."""
    from pathlib import Path

    objects = kube_manifests.manifests(plan, options)
    text = kube_manifests.to_yaml(objects)
    if output is None:
        console.out(text, highlight=False, end="")
        return ""
    try:
        Path(output).write_text(text)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {output}: {exc.strerror}", "give a writable --output"
        ) from None
    kinds = ", ".join(o["kind"] for o in objects)
    return f"[bold]Wrote[/] {output} ({kinds}): kubectl apply -f {output}"


def _make(model, where: InventoryFlags, engine: EngineKwargs, plan_only: dict):
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan
    from llmctl.engine.config.engine_config import parse_layer_partition

    spec = load_model_spec(model)
    inv = where.resolve()
    if "pipeline_layer_partition" in engine:
        partition = parse_layer_partition(engine["pipeline_layer_partition"])
        engine = {**engine, "pipeline_layer_partition": partition}
    # An engine option not given is left out: PlanOptions' default, the engine's.
    return make_plan(spec, inv, PlanOptions(**engine, **plan_only))


def _print_catalog(console, catalog, as_json: bool) -> None:
    rows = [
        {
            "name": spec.name,
            "architecture": spec.architecture,
            "params_b": round(spec.total_params() / 1e9, 3),
            "layers": spec.num_layers,
            "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "max_model_len": spec.max_position_embeddings,
            "dtype": spec.dtype,
        }
        for spec in catalog.values()
    ]
    if as_json:
        console.out(json.dumps(rows, indent=2), highlight=False)
        return
    table = Table(title="Model catalog (typed-in public configs)")
    for column in ("name", "architecture", "params", "layers", "heads / KV", "context", "dtype"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["name"],
            r["architecture"],
            f"{r['params_b']:.2f}B",
            str(r["layers"]),
            f"{r['heads']} / {r['kv_heads']}",
            f"{r['max_model_len']:,}",
            r["dtype"],
        )
    console.print(table)


def _print_plan(console, plan) -> None:
    gib = 1 << 30
    dp = plan.data_parallel_size
    replicas = f", data_parallel_size={dp} (each replica)" if dp > 1 else ""
    console.print(
        f"[bold]{plan.model}[/]: tensor_parallel_size={plan.tensor_parallel_size}, "
        f"pipeline_parallel_size={plan.pipeline_parallel_size}{replicas} on {plan.gpus_used} "
        f"GPU(s), {plan.nodes_used} node(s), {plan.distributed_executor_backend} backend, "
        f"{plan.dtype}"
    )
    table = Table(title="Per GPU")
    for column in ("rank", "node", "stage", "tp rank", "layers", "weights", "activations",
                   "non-torch", "KV cache", "KV blocks"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in plan.ranks:
        table.add_row(
            str(r.rank),
            str(r.node),
            str(r.pp_rank),
            str(r.tp_rank),
            f"{r.layers[0]}-{r.layers[1] - 1}",
            f"{r.weight_bytes / gib:.2f} GiB",
            f"{r.activation_bytes / gib:.2f} GiB",
            f"{r.non_torch_bytes / gib:.2f} GiB",
            f"{r.num_blocks * r.kv_block_bytes / gib:.2f} GiB",
            f"{r.num_blocks:,}",
        )
    console.print(table)
    console.print(plan.weight_line, highlight=False)
    memory = plan.memory_lines()
    console.print(memory[0], highlight=False)
    for line in memory[1:]:
        console.print(f"  - {line}", highlight=False)
    for line in plan.log_lines():
        console.print(line, highlight=False)
    for line in plan.replica_lines():
        console.print(line, highlight=False)
    console.print("\n[bold]Why[/]")
    for reason in plan.reasons:
        console.print(f"  - {reason}", highlight=False)
    if plan.alternatives:
        console.print("[bold]Also possible[/]")
        for layout, offer in plan.alternatives:
            console.print(f"  - {layout}: {offer}", highlight=False)
    if plan.rejected:
        console.print("[bold]Rejected[/]")
        for layout, why in plan.rejected:
            console.print(f"  - {layout}: {why}", highlight=False)
    console.print("[bold]Run[/]")
    for command in plan.commands.values():  # in order: `cluster up` before `serve -i`
        console.print(f"  {command}", highlight=False, soft_wrap=True)
