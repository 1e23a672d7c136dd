"""`llmctl doctor`: can these nodes serve a model together? Parse, call llmctl.cluster, render.

`llmctl doctor` (or `doctor check`) collects each node's facts (this machine, or every node of the
Ray cluster with --ray), runs the checklist of cluster/doctor/doctor_checks.py and the all-reduce
check, and prints one row per check and node. `llmctl doctor nccl` runs only the all-reduce check
and prints its timings and links. Both exit 1 when something fails; --json for programs.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from llmctl.cli.console import print_error, stdout_console
from llmctl.engine.errors import LLMCtlError

app = typer.Typer(
    name="doctor",
    help="Check that the cluster's nodes can serve a model together (network, environment, "
    "versions, all-reduce).",
)


class Backend(enum.StrEnum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


OnRay = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Every node of the Ray cluster this machine reaches (RAY_ADDRESS, or the cluster "
        "`ray start` joined here), one rank per node; without it, this machine only.",
    ),
]
BackendOption = Annotated[
    Backend,
    typer.Option(case_sensitive=False, help="auto: Gloo, plus NCCL where every rank has a GPU."),
]
Timeout = Annotated[
    float,
    typer.Option(
        min=0.1,
        help="Seconds before a hung check is stopped: the whole local run; with --ray, "
        "each step (placing the actors, each all-reduce).",
    ),
]
WorldSize = Annotated[
    int, typer.Option("--world-size", min=1, help="Local ranks (processes), without --ray.")
]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Model = Annotated[
    str | None,
    typer.Option(help="A model directory or .gguf file that must be identical on every node."),
]
Nvlink = Annotated[
    bool | None,
    typer.Option(
        "--nvlink/--pcie",
        help="What the plan assumed between each node's GPUs; NVLink fails where absent.",
        show_default=False,
    ),
]
InventoryOption = Annotated[
    str | None,
    typer.Option(
        "--inventory",
        "-i",
        help="Check the cluster of this inventory from here: each node's container over SSH, "
        "then the checks on Ray from inside the head container (on an mp cluster: each "
        "container's facts, and the all-reduce with one rank per node over --nnodes).",
    ),
]
NoCollective = Annotated[
    bool, typer.Option("--no-allreduce", help="Skip the all-reduce check (facts only).")
]

_STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


@app.callback(invoke_without_command=True)
def doctor(
    ctx: typer.Context,
    ray: OnRay = False,
    model: Model = None,
    nvlink: Nvlink = None,
    backend: BackendOption = Backend.auto,
    world_size: WorldSize = 2,
    timeout: Timeout = 60.0,
    no_allreduce: NoCollective = False,
    json_output: JsonOutput = False,
    inventory: InventoryOption = None,
) -> None:
    """The whole checklist (same as `doctor check`); `doctor nccl` for the all-reduce alone."""
    if ctx.invoked_subcommand is None:
        with _json_errors(json_output):
            if inventory is not None:
                _on_cluster(inventory, False, backend, timeout, nvlink, json_output)
                return
            _check(ray, model, nvlink, backend, world_size, timeout, no_allreduce, json_output)


@app.command()
def check(
    ray: OnRay = False,
    model: Model = None,
    nvlink: Nvlink = None,
    backend: BackendOption = Backend.auto,
    world_size: WorldSize = 2,
    timeout: Timeout = 60.0,
    no_allreduce: NoCollective = False,
    json_output: JsonOutput = False,
    inventory: InventoryOption = None,
) -> None:
    """Check every node: VLLM_HOST_IP, NCCL/Gloo interfaces, environment, /dev/shm, versions,
    model, NVLink, and the all-reduce. One row per check and node; exit 1 if any fails."""
    with _json_errors(json_output):
        if inventory is not None:
            _on_cluster(inventory, False, backend, timeout, nvlink, json_output)
            return
        _check(ray, model, nvlink, backend, world_size, timeout, no_allreduce, json_output)


_NODES = "Across nodes without Ray"


@app.command()
def nccl(
    ray: OnRay = False,
    backend: BackendOption = Backend.auto,
    world_size: WorldSize = 2,
    timeout: Timeout = 60.0,
    json_output: JsonOutput = False,
    inventory: InventoryOption = None,
    nnodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Spread --world-size ranks over this many nodes (the mp backend): this is node "
            "0; node R runs `llmctl serve --headless -pp WORLD_SIZE --nnodes N --node-rank R "
            "--master-addr A --master-port P`.",
            rich_help_panel=_NODES,
        ),
    ] = 1,
    master_addr: Annotated[
        str | None,
        typer.Option(help="This node's address, which the others reach.", rich_help_panel=_NODES),
    ] = None,
    master_port: Annotated[
        int, typer.Option(help="The rendezvous port (and the next).", rich_help_panel=_NODES)
    ] = 29501,
    cluster_secret_file: Annotated[
        str | None,
        typer.Option(
            help="A file holding the cluster's secret, which the nodes prove they hold when "
            "they join. (default: $LLMCTL_CLUSTER_SECRET)",
            show_default=False,
            rich_help_panel=_NODES,
        ),
    ] = None,
    insecure_join: Annotated[
        bool,
        typer.Option(
            "--insecure-join",
            help="Let nodes join without a cluster secret. RISK: anyone who reaches this node's "
            "ports, or poses as it, runs code on the nodes.",
            rich_help_panel=_NODES,
        ),
    ] = False,
) -> None:
    """The all-reduce sanity check: latency, bus bandwidth and per-link numbers, the sums
    checked, and the transport NCCL chose; exit 1 if a rank hangs, dies or sums wrong."""
    with _json_errors(json_output):
        if inventory is not None:
            _on_cluster(inventory, True, backend, timeout, None, json_output)
            return
        nodes = dict(nnodes=nnodes, master_addr=master_addr, master_port=master_port)
        if nnodes > 1:
            nodes.update(cluster_secret_file=cluster_secret_file, insecure_join=insecure_join)
        _nccl(ray, backend, world_size, timeout, json_output, nodes)


@contextlib.contextmanager
def _json_errors(enabled: bool) -> Iterator[None]:
    """With --json, a typed error is a JSON object on stdout as well (exit 1), as in `plan`."""
    try:
        yield
    except LLMCtlError as exc:
        if not enabled:
            raise
        payload = {"ok": False, "error": exc.message, "hint": exc.hint}
        stdout_console().out(json.dumps(payload, indent=2), highlight=False)
        raise typer.Exit(1) from None


def _nccl(ray, backend, world_size, timeout, json_output, nodes: dict | None = None) -> None:
    from llmctl.cluster.doctor.local_doctor import allreduce_here

    collectives, payload = allreduce_here(ray, backend.value, world_size, timeout, nodes)
    ok = all(c.ok for c in collectives)
    console = stdout_console()
    if json_output:
        console.out(json.dumps({"ok": ok, **payload}, indent=2), highlight=False)
    else:
        for report in collectives:
            _print_collective(console, report)
    if not ok:
        raise typer.Exit(1)


def _check(ray, model, nvlink, backend, world_size, timeout, no_allreduce, json_output) -> None:
    from llmctl.cluster.doctor.doctor_checks import failed
    from llmctl.cluster.doctor.local_doctor import check_here

    run = check_here(ray, model, nvlink, backend.value, world_size, timeout, not no_allreduce)
    bad = failed(run.results)
    console = stdout_console()
    if json_output:
        payload = {
            "ok": not bad,
            "checks": [r.to_json() for r in run.results],
            "nodes": [r.to_json() for r in run.reports],
            "collectives": [c.to_json() for c in run.collectives],
        }
        console.out(json.dumps(payload, indent=2), highlight=False)
    else:
        _print_results(console, run.results)
    if bad:
        raise typer.Exit(1)


def _on_cluster(inventory, nccl, backend, timeout, nvlink, json_output) -> None:
    from llmctl.cluster.doctor.cluster_doctor import run_doctor
    from llmctl.cluster.inventory import load_inventory
    from llmctl.cluster.launch.launcher import Cluster

    with Cluster(load_inventory(inventory)) as cluster:
        run = run_doctor(cluster, nccl=nccl, backend=backend.value, timeout=timeout, nvlink=nvlink)
    console = stdout_console()
    if json_output:
        payload = {**run.payload, "ok": run.ok, "checks": [r.to_json() for r in run.results]}
        if run.text:
            payload["output"] = run.text
        console.out(json.dumps(payload, indent=2), highlight=False)
    else:
        if nccl:
            bad = [r for r in run.results if r.status != "pass"]
            if bad:
                _print_results(console, bad)
            console.out(run.text, highlight=False, end="")
        else:
            _print_results(console, run.results)
    if not run.ok:
        raise typer.Exit(1)


def _print_results(console, results) -> None:
    table = Table(title="llmctl doctor")
    for column in ("check", "node", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(
            Text(r.check),
            Text(r.node),
            Text(r.status, style=_STATUS_STYLE[r.status]),
            Text(r.detail),
            Text(r.fix or ""),
        )
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "warn", "fail")}
    console.print(
        f"{len(results)} checks: {counts['pass']} pass, {counts['warn']} warn, "
        f"{counts['fail']} fail",
        highlight=False,
    )


def _print_collective(console, report) -> None:
    from llmctl.cluster.doctor.collective_report import format_bytes
    from llmctl.cluster.doctor.nccl_log import assess_transport
    from llmctl.cluster.errors import CollectiveError

    nodes = ", ".join(dict.fromkeys(report.nodes))
    title = f"{report.backend} all-reduce, {report.world_size} rank(s) on {nodes}"
    if report.error is not None:
        table = Table(title=title)
        for column in ("rank", "node", "last stage"):
            table.add_column(column)
        for rank, stage in enumerate(report.stages):
            table.add_row(str(rank), Text(report.nodes[rank]), stage or "not started")
        console.print(table)
        print_error(CollectiveError(report.error, report.hint))
        return
    table = Table(title=title)
    for column in ("size", "iterations", "time", "algbw", "busbw", "sum"):
        table.add_column(column, justify="right")
    for s in report.sizes:
        table.add_row(
            format_bytes(s.size_bytes),
            str(s.iterations),
            f"{s.time_us:,.1f} us",
            f"{s.algbw_gbps:.3f} GB/s",
            f"{s.busbw_gbps:.3f} GB/s",
            Text("correct", style="green") if s.correct else Text("WRONG", style="bold red"),
        )
    console.print(table)
    if report.links:
        links = Table(title="links from rank 0")
        for column in ("link", "latency", "bandwidth", "transport"):
            links.add_column(column)
        for link in report.links:
            links.add_row(
                Text(f"{link.src_rank} ({link.src_node}) -> {link.dst_rank} ({link.dst_node})"),
                f"{link.latency_us:,.1f} us",
                f"{link.bandwidth_gbps:.3f} GB/s",
                link.transport or "-",
            )
        console.print(links)
    if report.transport is not None:
        status, detail, fix = assess_transport(report.transport, report.cross_node)
        console.print(Text.assemble(("transport: ", "bold"), (detail, _STATUS_STYLE[status])))
        if fix:
            console.print(Text.assemble(("fix: ", "bold yellow"), fix))
    if not report.correct:
        try:
            report.raise_for_failure()
        except CollectiveError as exc:
            print_error(exc)
