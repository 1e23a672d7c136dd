"""`llmctl serve`: the OpenAI-compatible API server on the bundled engine.

Parse the options into EngineArgs, call `run_server`; the server logs the KV-cache lines, then the
address it listens on, and runs until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.console import CliState, stderr_console, stdout_console
from llmctl.cli.engine_options import EngineKwargs, Model, engine_options
from llmctl.engine import envs
from llmctl.engine.entrypoints.openai.server_config import ServerConfig
from llmctl.engine.errors import ConfigError

app = typer.Typer()
_CLUSTER = "Cluster"
ServerKwargs = dict  # ServerConfig keywords: the server options a user gave


# `serve -i`'s options (the Cluster panel)
ClusterInventory = Annotated[
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
]
ClusterBackend = Annotated[
    str | None,
    typer.Option(
        help="With -i: ray, or mp (`llmctl serve --nnodes N` in each node's container, no "
        "Ray). (default: the backend `cluster up` started the containers on)",
        show_default=False,
        rich_help_panel=_CLUSTER,
    ),
]
ClusterStop = Annotated[
    bool,
    typer.Option("--stop", help="With -i: stop the cluster's server.", rich_help_panel=_CLUSTER),
]
NoApiKey = Annotated[
    bool,
    typer.Option(
        "--no-api-key",
        help="With -i: serve without an API key. (default: serve -i makes one, kept in "
        "~/.llmctl/NAME-api.env on the head node; `cluster status` says where)",
        rich_help_panel=_CLUSTER,
    ),
]
ClusterWait = Annotated[
    float, typer.Option(help="With -i: seconds to wait for /health.", rich_help_panel=_CLUSTER)
]


@app.command()
@engine_options("serve")
@engine_options("serve", param="server", args_class=ServerConfig)
def serve(
    ctx: typer.Context,
    model: Model = None,
    # ServerConfig's options of `serve` (@engine_options), then EngineArgs'; served_model_name
    # shows in the Server panel with the former, the others in the Engine and Parallelism panels.
    server: ServerKwargs = None,
    engine: EngineKwargs = None,
    inventory: ClusterInventory = None,
    backend: ClusterBackend = None,
    stop: ClusterStop = False,
    no_api_key: NoApiKey = False,
    wait: ClusterWait = 600.0,
) -> None:
    """Serve a model with an OpenAI-compatible API (/v1/completions, /v1/chat/completions).

    Try it: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json'
    -d '{"prompt": "The capital of France is", "max_tokens": 16}'
    """
    state: CliState = ctx.obj or CliState()
    if inventory is not None:
        from llmctl.cluster.launch.cluster_serve import cluster_serve_options

        o = cluster_serve_options(engine, server, backend)
        _serve_on_cluster(
            inventory, model, o.tensor_parallel_size, o.pipeline_parallel_size, o.port,
            o.engine, server=o.server, stop=stop, wait=wait, backend=o.backend,
            api_key=not no_api_key,
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
        **{**server, "api_key": server.get("api_key") or envs.LLMCTL_API_KEY}
    )
    if state.progress:
        with rich_progress() as progress:
            run_server(engine_args, server_config, progress)
    else:
        run_server(engine_args, server_config)


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
    from llmctl.cluster.launch.cluster_serve import ClusterServeOptions, serve_on_cluster

    log = lambda line: stderr_console().print(f"[dim]{line}[/dim]")  # noqa: E731
    asked = ClusterServeOptions(tp, pp, port, options, server, backend, make_api_key=api_key)
    done = serve_on_cluster(inventory_path, model, asked, stop=stop, wait=wait, log=log)
    if stop:
        outcome = "server stopped" if done.stopped else "no server was running"
        stdout_console().print(f"cluster {done.cluster}: {outcome}")
        return
    record = done.record
    replicas = f"dp={done.data_parallel_size}, " if done.data_parallel_size > 1 else ""
    stdout_console().print(
        f"cluster {done.cluster}: serving {done.model} ({replicas}"
        f"tp={record.tensor_parallel_size}, pp={record.pipeline_parallel_size}, "
        f"pid {done.state.pid}) at {done.endpoint}"
    )
    stdout_console().print(f"API key: {done.api_key}", soft_wrap=True)
