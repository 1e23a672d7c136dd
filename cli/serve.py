"""`llmctl serve`: the OpenAI-compatible API server on the bundled engine.

Parse the options into EngineArgs, call `run_server`; the server logs the KV-cache lines, then the
address it listens on, and runs until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated

import typer

from llmctl.cli.console import CliState, stderr_console, stdout_console
from llmctl.cli.engine_options import EngineKwargs, Model, engine_options
from llmctl.engine.config.engine_args import SERVER
from llmctl.engine.errors import ConfigError

app = typer.Typer()
_CLUSTER = "Cluster"


@app.command()
@engine_options("serve")
def serve(
    ctx: typer.Context,
    model: Model = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on.", rich_help_panel=SERVER)
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", rich_help_panel=SERVER)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require `Authorization: Bearer KEY` on every route but /health. "
            "(default: $LLMCTL_API_KEY, else none)",
            show_default=False,
            rich_help_panel=SERVER,
        ),
    ] = None,
    # The EngineArgs options of `serve` (@engine_options); served_model_name shows here, in the
    # Server panel, the others after it in the Engine and Parallelism panels.
    engine: EngineKwargs = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="On SIGTERM, seconds to let in-flight requests finish (a second SIGTERM or "
            "Ctrl-C stops at once).",
            rich_help_panel=SERVER,
        ),
    ] = 30.0,
    max_request_body_bytes: Annotated[
        int | None,
        typer.Option(
            help="Largest request body accepted, in bytes; larger ones get 413. (default: the "
            "largest whose prompt could still fit --max-model-len)",
            show_default=False,
            rich_help_panel=SERVER,
        ),
    ] = None,
    http_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a client may stall while sending its request or reading a stream "
            "before its connection is closed.",
            rich_help_panel=SERVER,
        ),
    ] = 30.0,
    inventory: Annotated[
        str | None,
        typer.Option(
            "--inventory",
            "-i",
            help="Serve on the cluster of this inventory (started by `llmctl cluster up`): in "
            "its head container on the Ray backend, or in every node's container on the mp "
            "backend; the layout from `llmctl plan` unless -tp/-pp are given. MODEL defaults to "
            "the inventory's `model`.",
            rich_help_panel=_CLUSTER,
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            help="With -i: ray, or mp (`llmctl serve --nnodes N` in each node's container, no "
            "Ray). (default: the backend `cluster up` started the containers on)",
            show_default=False,
            rich_help_panel=_CLUSTER,
        ),
    ] = None,
    stop: Annotated[
        bool,
        typer.Option(
            "--stop", help="With -i: stop the cluster's server.", rich_help_panel=_CLUSTER
        ),
    ] = False,
    no_api_key: Annotated[
        bool,
        typer.Option(
            "--no-api-key",
            help="With -i: serve without an API key. (default: serve -i makes one, kept in "
            "~/.llmctl/NAME-api.env on the head node; `cluster status` says where)",
            rich_help_panel=_CLUSTER,
        ),
    ] = False,
    wait: Annotated[
        float,
        typer.Option(help="With -i: seconds to wait for /health.", rich_help_panel=_CLUSTER),
    ] = 600.0,
) -> None:
    """Serve a model with an OpenAI-compatible API (/v1/completions, /v1/chat/completions).

    Try it: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json'
    -d '{"prompt": "The capital of France is", "max_tokens": 16}'
    """
    from llmctl.engine.entrypoints.openai.server_config import ServerConfig

    state: CliState = ctx.obj or CliState()
    if inventory is not None:
        if api_key:
            raise ConfigError(
                "--api-key would show on the head's command line",
                "put LLMCTL_API_KEY in the inventory's `env` (it reaches the container through "
                "its 0600 env file) and run `llmctl cluster up` again",
            )
        tp = engine.pop("tensor_parallel_size", None)
        pp = engine.pop("pipeline_parallel_size", None)
        executor = engine.pop("distributed_executor_backend", None)
        if backend and executor and backend != executor:
            raise ConfigError(
                f"--backend {backend} and --distributed-executor-backend {executor} disagree",
                "give one of them",
            )
        # The server's options go along where given (the head's own address is 0.0.0.0).
        server = {
            name: value
            for name, value in (
                ("shutdown_timeout", shutdown_timeout),
                ("max_request_body_bytes", max_request_body_bytes),
                ("http_timeout", http_timeout),
            )
            if value != getattr(ServerConfig, name)
        }
        _serve_on_cluster(
            inventory, model, tp, pp, port, engine, server=server, stop=stop, wait=wait,
            backend=backend or executor, api_key=not no_api_key,
        )  # fmt: skip
        return
    if backend is not None:
        raise ConfigError("--backend picks a cluster's backend", "add -i cluster.yaml")
    if stop:
        raise ConfigError("--stop stops a cluster's server", "add -i cluster.yaml")
    if no_api_key:
        raise ConfigError(
            "--no-api-key keeps `serve -i` from making a key; here there is none unless "
            "--api-key gives one",
            "drop --no-api-key",
        )
    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.entrypoints.openai.api_server import run_server
    from llmctl.engine.progress import rich_progress

    engine_args = EngineArgs(model=model, **engine)
    if engine_args.data_parallel_placement().headless:  # replicas for the head's router
        from llmctl.engine.dp.replica_server import run_dp_headless

        run_dp_headless(engine_args)
        return
    if engine_args.headless:  # this node's ranks, driven by node 0's engine; no API here
        from llmctl.engine.executor.node_agent import run_headless

        restarts = engine_args.max_restarts if engine_args.restart_on_failure else 0
        run_headless(engine_args.create_parallel_config(), max_restarts=restarts)
        return
    server_config = ServerConfig(
        host=host,
        port=port,
        api_key=api_key or os.environ.get("LLMCTL_API_KEY") or None,
        shutdown_timeout=shutdown_timeout,
        max_request_body_bytes=max_request_body_bytes,
        http_timeout=http_timeout,
    )
    if state.progress:
        with rich_progress() as progress:
            run_server(engine_args, server_config, progress)
    else:
        run_server(engine_args, server_config)


def _check_replicas_on(backend: str | None, dp: int) -> None:
    """Data-parallel replicas on a cluster are Ray's to place: the mp backend's group is one
    engine across the inventory's nodes."""
    if dp > 1 and backend == "mp":
        raise ConfigError(
            f"--data-parallel-size {dp} with -i on the mp backend: its group runs one engine "
            "across the inventory's nodes, not replicas",
            "serve on the Ray backend (`cluster up --backend ray`: Ray places each replica's "
            f"workers), or run the per-node commands of `llmctl plan -i ... -dp {dp}` "
            "(--data-parallel-size-local, --headless)",
        )


def _serve_on_cluster(
    inventory_path: str,
    model: str | None,
    tp: int | None,
    pp: int | None,
    port: int,
    options: EngineKwargs,
    *,
    server: dict,
    stop: bool,
    wait: float,
    backend: str | None = None,
    api_key: bool = True,
) -> None:
    from llmctl.cluster.inventory import load_inventory
    from llmctl.cluster.launch.group_server import (
        GroupServer,
        check_cluster_backend,
        check_cluster_options,
        group_record,
    )
    from llmctl.cluster.launch.head_server import (
        HeadServer,
        ServerRecord,
        api_key_source,
        choose_layout,
        serve_argv,
    )
    from llmctl.cluster.launch.launcher import Cluster
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    dp = int(options.get("data_parallel_size", 1))  # type: ignore[call-overload]
    _check_replicas_on(backend, dp)  # a backend given: before any connection
    inv = load_inventory(inventory_path)
    log = lambda line: stderr_console().print(f"[dim]{line}[/dim]")  # noqa: E731
    with Cluster(inv, log=log) as cluster:
        running_on = cluster.backend()
        backend = check_cluster_backend(backend, running_on, inv.source, stop=stop)
        transport = cluster.transports[inv.head.host]
        head = (
            GroupServer(inv, cluster.transports, cluster.container)
            if backend == "mp"
            else HeadServer(inv, transport, cluster.container)
        )
        if stop:
            stopped = head.stop()
            stdout_console().print(f"cluster {inv.name}: " + ("server stopped" if stopped
                                   else "no server was running"))  # fmt: skip
            return
        model = model or inv.model
        if not model:
            raise ConfigError(f"{inv.source} names no model", "pass MODEL or add `model:` to it")
        _check_replicas_on(backend, dp)
        plan_options = PlanOptions(data_parallel_size=dp) if dp > 1 else None
        layout = choose_layout(
            inv, model, tp, pp, lambda m, i: make_plan(load_model_spec(m), i, plan_options), dp
        )
        check_cluster_options(options)
        if backend == "mp":
            record = group_record(model, layout, port, options, server, inv)
            where = f"on {len(inv.nodes)} nodes, mp backend"
        else:
            argv = serve_argv(model, layout, port, options, server)
            record = ServerRecord(
                model, port, layout.tensor_parallel_size, layout.pipeline_parallel_size,
                tuple(argv),
            )  # fmt: skip
            where = f"on {inv.head.host}"
        if api_key:  # its env file on the head node: on no command line
            record = dataclasses.replace(record, api_key_file=head.api_key_file())
        log(
            f"serving {model} with tp={layout.tensor_parallel_size} "
            f"pp={layout.pipeline_parallel_size} ({layout.reason}) in {cluster.container} "
            f"{where}"
        )
        state = head.start(record, wait_s=wait, log=log)
    replicas = f"dp={dp}, " if dp > 1 else ""
    stdout_console().print(
        f"cluster {inv.name}: serving {model} ({replicas}tp={record.tensor_parallel_size}, "
        f"pp={record.pipeline_parallel_size}, pid {state.pid}) at {record.endpoint(inv.head.ip)}"
    )
    stdout_console().print(f"API key: {api_key_source(record, inv)}", soft_wrap=True)
