"""`llmctl cluster up/down/status/logs/exec`: parse, call llmctl.cluster, render.

Two ways to run it: with `-i cluster.yaml` it drives every node of the inventory over SSH; with
`--head`/`--worker` it starts this node's container (what run_cluster.sh does, but detached).
"""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer
from rich.table import Table

from llmctl.cli.console import stderr_console, stdout_console
from llmctl.engine.errors import ConfigError

app = typer.Typer(
    name="cluster",
    help="Start, inspect and stop a cluster of llmctl containers (on Ray, or the mp backend).",
)

Inventory = Annotated[
    str | None,
    typer.Option("--inventory", "-i", help="The cluster's inventory (see templates/cluster.yaml)."),
]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Print the exact commands per node; change nothing.")
]


def _log(line: str) -> None:
    stderr_console().print(f"[dim]{line}[/dim]")


def _cluster(inventory: str):
    from llmctl.cluster.inventory import load_inventory
    from llmctl.cluster.launch.launcher import Cluster

    return Cluster(load_inventory(inventory), log=_log)


def _need_inventory(inventory: str | None, command: str) -> str:
    if inventory is None:
        raise ConfigError(
            f"cluster {command} needs an inventory",
            "pass -i cluster.yaml (see templates/cluster.yaml)",
        )
    return inventory


@app.command()
def up(
    inventory: Inventory = None,
    head: Annotated[bool, typer.Option("--head", help="Start this node's head container.")] = False,
    worker: Annotated[
        bool, typer.Option("--worker", help="Start this node's worker container.")
    ] = False,
    image: Annotated[
        str | None, typer.Option(help="The llmctl image (default: the inventory's `image`).")
    ] = None,
    image_file: Annotated[
        str | None,
        typer.Option(
            help="A `docker save` file, loaded on the nodes that lack the image (each is sent "
            "only the layers it does not hold)."
        ),
    ] = None,
    sync_model: Annotated[
        bool, typer.Option("--sync-model", help="Copy the model to the nodes that lack it.")
    ] = False,
    allow_public_ip: Annotated[
        bool,
        typer.Option(
            "--allow-public-ip", help="Accept public VLLM_HOST_IPs (unencrypted traffic)."
        ),
    ] = False,
    ip: Annotated[
        str | None,
        typer.Option(help="--head/--worker: this node's VLLM_HOST_IP (default: $VLLM_HOST_IP)."),
    ] = None,
    head_ip: Annotated[str | None, typer.Option(help="--worker: the head node's IP.")] = None,
    hf_home: Annotated[
        str | None, typer.Option(help="--head/--worker: mounted at /root/.cache/huggingface.")
    ] = None,
    num_gpus: Annotated[
        int | None, typer.Option(help="--head/--worker: GPUs Ray declares (default: detected).")
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", "-e", help="--head/--worker: NAME=value for the container."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="ray: a Ray cluster in the containers. mp: no Ray (an image from `llmctl "
            "image build --no-ray` will do); the containers wait with the model and the env "
            "for `llmctl serve -i --backend mp`, which starts `llmctl serve --nnodes` on each.",
        ),
    ] = "ray",
    dry_run: DryRun = False,
) -> None:
    """Start the cluster (idempotent: an unchanged node is left alone)."""
    if head and worker:
        raise ConfigError("--head and --worker exclude each other", "pass one of them")
    if head or worker:
        if inventory:
            raise ConfigError(
                "--head/--worker start this node only", "drop -i, or drop --head/--worker"
            )
        report = _up_local("head" if head else "worker", ip, head_ip, image, hf_home, num_gpus,
                           env or [], dry_run, backend)  # fmt: skip
    else:
        with _cluster(_need_inventory(inventory, "up")) as cluster:
            report = cluster.up(
                image=image, image_file=image_file, sync_model=sync_model,
                allow_public_ip=allow_public_ip, dry_run=dry_run, backend=backend,
            )  # fmt: skip
    _render(report, "up")


def _up_local(role, ip, head_ip, image, hf_home, num_gpus, env, dry_run, backend):
    import os

    from llmctl.cluster.launch.local_node import up_this_node

    variables = {}
    for item in env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--env {item!r} is not NAME=value", "write it as -e NAME=value")
        variables[name] = value
    return up_this_node(
        role, ip=ip or os.environ.get("VLLM_HOST_IP"), head_ip=head_ip, image=image,
        hf_home=hf_home, gpus=num_gpus, env=variables, dry_run=dry_run, backend=backend,
    )  # fmt: skip


@app.command()
def down(inventory: Inventory = None, dry_run: DryRun = False) -> None:
    """Remove every container the cluster created (with -i), or this node's (without)."""
    if inventory is None:
        from llmctl.cluster.launch.local_node import down_local
        from llmctl.cluster.launch.transport import LocalTransport

        report = down_local(LocalTransport(), dry_run=dry_run)
    else:
        with _cluster(inventory) as cluster:
            report = cluster.down(dry_run=dry_run)
    _render(report, "down")
    if any(row.error for row in report.rows):
        raise typer.Exit(1)


@app.command()
def status(inventory: Inventory = None) -> None:
    """Containers, Ray nodes (or, on the mp backend, each node's server process), GPUs and
    versions per node."""
    with _cluster(_need_inventory(inventory, "status")) as cluster:
        report = cluster.status()
    mp = report.backend == "mp"
    table = Table(title=f"cluster {report.cluster}" + (" (mp backend, no Ray)" if mp else ""))
    for column in ("Node", "Role", "VLLM_HOST_IP", "Container",
                   *(("Server process",) if mp else ("Ray node", "GPUs")),
                   "Python", "torch", "Ray", "llmctl"):  # fmt: skip
        table.add_column(column)
    for row in report.rows:
        v = row.versions
        if mp:
            process = report.server_nodes.get(row.host)
            placed = [_process(process)]
        else:
            placed = ["alive" if row.ray_ip else "-", _gpus(row.gpus)]
        table.add_row(
            row.host, row.role, row.ip, row.status + (f" ({row.error})" if row.error else ""),
            *placed, *(v.get(k) or "-" for k in ("python", "torch", "ray", "llmctl")),
        )  # fmt: skip
    stdout_console().print(table)
    if report.ray is not None:
        stdout_console().print(
            f"Ray: {len(report.ray.active_nodes)} nodes, {report.ray.gpus:g} GPUs,"
            f" {report.ray.totals.get('CPU', 0):g} CPUs"
        )
    if report.server is not None:
        record, state = report.server
        head_ip = next(r.ip for r in report.rows if r.role == "head")
        where = f", mp on {len(record.workers) + 1} nodes" if record.backend == "mp" else ""
        stdout_console().print(
            f"Server: {record.model} (tp={record.tensor_parallel_size},"
            f" pp={record.pipeline_parallel_size}{where}) at {record.endpoint(head_ip)}:"
            f" {state.label}"
        )
    if report.server_note is not None:
        stdout_console().print(f"Server: {report.server_note}", soft_wrap=True)
    if report.joins is not None:
        stdout_console().print(f"Joins: {report.joins}", soft_wrap=True)
    if report.api_key is not None:
        stdout_console().print(f"API key: {report.api_key}", soft_wrap=True)


@app.command()
def logs(
    node: Annotated[str, typer.Argument(help="The node: its host, its ip, or `head`.")],
    inventory: Inventory = None,
    tail: Annotated[int | None, typer.Option(help="Only the last N lines.")] = None,
) -> None:
    """The node container's log (ray start's output)."""
    with _cluster(_need_inventory(inventory, "logs")) as cluster:
        result = cluster.logs(node, tail)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    raise typer.Exit(result.returncode)


@app.command(
    name="exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def exec_(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="The node: its host, its ip, or `head`.")],
    inventory: Inventory = None,
) -> None:
    """Run a command in the node's container: llmctl cluster exec NODE -i F -- CMD ARGS..."""
    argv = list(ctx.args)
    if not argv:
        raise ConfigError(
            "no command given", "write it after --: llmctl cluster exec NODE -- ray status"
        )
    with _cluster(_need_inventory(inventory, "exec")) as cluster:
        result = cluster.exec(node, argv)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    raise typer.Exit(result.returncode)


def _process(state) -> str:
    """An mp node's `llmctl serve` process."""
    if state is None:
        return "-"
    return f"running (pid {state.pid})" if state.running else "stopped"


def _gpus(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _render(report, command: str) -> None:
    console = stdout_console()
    if report.dry_run:
        for host, argvs in report.commands.items():
            console.print(f"[bold]{host}[/bold]")
            for argv in argvs:
                console.print(f"  {shlex.join(argv)}", soft_wrap=True, markup=False)
            env = report.env.get(host)
            if env:
                console.print("  env file:", markup=False)
                for name, value in env.items():
                    console.print(f"    {name}={value}", soft_wrap=True, markup=False)
    table = Table(
        title=f"cluster {report.cluster}: {command}" + (" (dry run)" if report.dry_run else "")
    )
    columns = ["Node", "Role", "VLLM_HOST_IP", "Container", "Action"]
    mp = report.backend == "mp"
    if command == "up":
        columns[3:3] = ["Interface"]
        columns += ["llmctl", "torch"] if mp else ["Ray node IP", "GPUs"]
    for column in columns:
        table.add_column(column)
    for row in report.rows:
        cells = [
            row.host,
            row.role,
            row.ip,
            row.container,
            row.action + (f": {row.error}" if row.error else ""),
        ]
        if command == "up":
            cells[3:3] = [row.ifname or "-"]
            if mp:
                cells += [row.versions.get("llmctl") or "-", row.versions.get("torch") or "-"]
            else:
                cells += [row.ray_ip or "-", _gpus(row.gpus)]
        table.add_row(*cells)
    console.print(table)
    for note in report.notes:
        console.print(note, soft_wrap=True)  # a command in it stays one line
    if command == "up" and not report.dry_run:
        if mp:
            n = len(report.rows)
            summary = f"{n} node{'s' if n != 1 else ''} ready for the mp backend (no Ray)"
        elif report.ray is not None:
            summary = f"{len(report.ray.active_nodes)} Ray nodes, {report.ray.gpus:g} GPUs"
        else:
            summary = "Ray is up"
        changed = "" if report.changed else "; nothing changed"
        console.print(f"cluster {report.cluster} is up: {summary}{changed}")
