"""serve_on_cluster: `llmctl serve -i INVENTORY`, from the options given to the server started.

    plan the layout (cluster/plan: -tp/-pp as given, else `llmctl plan`'s choice)
    -> each node's `llmctl serve` as RunSteps (cluster/plan/node_commands.serve_steps: one in
       the head's container on the Ray backend, one per node's container on the mp backend)
    -> start them in the nodes' containers and wait for /health (HeadServer / GroupServer)

The CLI (cli/serve.py) parses and prints; everything between is here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmctl.cluster.launch.head_server import ServerRecord, ServerState, api_key_source
from llmctl.engine.errors import ConfigError

# ServerConfig fields `serve -i` sets itself on the head (it listens on every address) or
# refuses (the API key would show on the head's command line).
_HEAD_OWNS = ("host", "port", "api_key")


@dataclass(frozen=True)
class ClusterServeOptions:
    """What `serve -i` was given, sorted: the layout apart from the other engine options."""

    tensor_parallel_size: int | None
    pipeline_parallel_size: int | None
    port: int
    engine: dict[str, Any]  # further EngineArgs keywords
    server: dict[str, Any]  # ServerConfig fields that differ from their defaults
    backend: str | None
    make_api_key: bool = True  # make the server's API key (head_server.py), unless --no-api-key


def cluster_serve_options(
    engine: dict[str, Any], server: dict[str, Any], backend: str | None
) -> ClusterServeOptions:
    """Sort the options of `llmctl serve -i` (EngineArgs and ServerConfig keywords given)."""
    from llmctl.engine.entrypoints.openai.server_config import ServerConfig

    if server.get("api_key"):
        raise ConfigError(
            "--api-key would show on the head's command line",
            "put LLMCTL_API_KEY in the inventory's `env` (it reaches the container through "
            "its 0600 env file) and run `llmctl cluster up` again",
        )
    engine = dict(engine)
    tp = engine.pop("tensor_parallel_size", None)
    pp = engine.pop("pipeline_parallel_size", None)
    executor = engine.pop("distributed_executor_backend", None)
    if backend and executor and backend != executor:
        raise ConfigError(
            f"--backend {backend} and --distributed-executor-backend {executor} disagree",
            "give one of them",
        )
    differing = {
        name: value
        for name, value in server.items()
        if name not in _HEAD_OWNS and value != getattr(ServerConfig, name)
    }
    port = server.get("port", ServerConfig.port)
    return ClusterServeOptions(tp, pp, port, engine, differing, backend or executor)


@dataclass(frozen=True)
class ClusterServed:
    """What `serve -i` did, for the CLI to print."""

    cluster: str
    model: str | None = None  # None: --stop
    record: ServerRecord | None = None
    state: ServerState | None = None
    endpoint: str = ""
    data_parallel_size: int = 1
    stopped: bool = False  # --stop: a server was running and was stopped
    api_key: str = ""  # where the server's API key is (head_server.api_key_source)


def check_replicas_on(backend: str | None, dp: int) -> None:
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


def serve_on_cluster(
    inventory_path: str,
    model: str | None,
    options: ClusterServeOptions,
    *,
    stop: bool = False,
    wait: float = 600.0,
    log: Callable[[str], None] = lambda line: None,
) -> ClusterServed:
    """Start (or with `stop`, stop) the cluster's server; raises typed errors naming the fix."""
    from llmctl.cluster.inventory import load_inventory
    from llmctl.cluster.launch.launcher import Cluster

    dp = int(options.engine.get("data_parallel_size", 1))
    check_replicas_on(options.backend, dp)  # a backend given: before any connection
    inv = load_inventory(inventory_path)
    with Cluster(inv, log=log) as cluster:
        backend = _backend(options.backend, cluster.backend(), inv.source, stop)
        head = _head_server(inv, cluster, backend)
        if stop:
            return ClusterServed(inv.name, stopped=head.stop())
        model = model or inv.model
        if not model:
            raise ConfigError(f"{inv.source} names no model", "pass MODEL or add `model:` to it")
        check_replicas_on(backend, dp)
        record, reason = _record(inv, model, options, backend, dp)
        if options.make_api_key:  # its env file on the head node: on no command line
            record = dataclasses.replace(record, api_key_file=head.api_key_file())
        where = f"{len(inv.nodes)} nodes, mp backend" if backend == "mp" else inv.head.host
        log(
            f"serving {model} with tp={record.tensor_parallel_size} "
            f"pp={record.pipeline_parallel_size} ({reason}) in {cluster.container} on {where}"
        )
        state = head.start(record, wait_s=wait, log=log)
    return ClusterServed(
        inv.name, model, record, state, record.endpoint(inv.head.ip), data_parallel_size=dp,
        api_key=api_key_source(record, inv),
    )  # fmt: skip


def _backend(asked: str | None, running_on: str, source: str, stop: bool) -> str:
    from llmctl.cluster.launch.group_server import check_cluster_backend

    return check_cluster_backend(asked, running_on, source, stop=stop)


def _head_server(inv, cluster, backend: str):
    from llmctl.cluster.launch.group_server import GroupServer
    from llmctl.cluster.launch.head_server import HeadServer

    if backend == "mp":
        return GroupServer(inv, cluster.transports, cluster.container)
    return HeadServer(inv, cluster.transports[inv.head.host], cluster.container)


def _record(
    inv, model: str, options: ClusterServeOptions, backend: str, dp: int
) -> tuple[ServerRecord, str]:
    """The layout (cluster/plan), then each node's argv, as the head keeps them."""
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.node_commands import check_cluster_options, choose_layout, serve_steps
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    plan_options = PlanOptions(data_parallel_size=dp) if dp > 1 else None
    layout = choose_layout(
        inv,
        model,
        options.tensor_parallel_size,
        options.pipeline_parallel_size,
        lambda m, i: make_plan(load_model_spec(m), i, plan_options),
        dp,
    )
    check_cluster_options(options.engine)
    steps = serve_steps(model, layout, options.port, options.engine, options.server, inv, backend)
    record = ServerRecord.from_steps(model, options.port, layout, steps, backend)
    return record, layout.reason
