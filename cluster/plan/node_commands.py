"""The `llmctl serve` each node of a cluster runs, built from a layout: pure argv builders.

    Ray backend   the head's container runs `llmctl serve ... --distributed-executor-backend ray`
    mp backend    every node's container runs `llmctl serve ... --nnodes N --node-rank r`, node 0
                  with the API, the others --headless

`serve_steps` gives them as RunSteps (the plan's vocabulary: argv and the node that runs it);
`llmctl serve -i` (cluster/launch/cluster_serve.py) executes them. The layout is the plan's
(`choose_layout`: -tp/-pp as given, else make_plan's choice, else the seeds' rule for a cluster
when the inventory lacks what planning needs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmctl.cluster.errors import ConfigError, PlanError
from llmctl.cluster.inventory import Inventory, NodeSpec, ordered_nodes
from llmctl.cluster.plan.plan import RunStep
from llmctl.engine.config.engine_args import engine_args_to_argv

MASTER_PORT = 29501  # the mp group's rendezvous port on the head (ParallelConfig's default)
# Options the launcher derives from the inventory on every node: refused from the user with -i.
DERIVED_OPTIONS = ("nnodes", "node_rank", "master_addr", "headless")


@dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    reason: str


def choose_layout(
    inventory: Inventory,
    model: str,
    tp: int | None,
    pp: int | None,
    plan_fn: Callable,
    data_parallel_size: int = 1,
) -> Layout:
    """The user's -tp/-pp; else `llmctl plan`'s choice; else the seeds' rule for a cluster
    (tp = GPUs per node, pp = nodes) when the inventory lacks what planning needs, for each of
    `data_parallel_size` replicas (nodes / replicas stages, or GPUs per node / replicas per
    node)."""
    if tp is not None or pp is not None:
        return Layout(tp or 1, pp or 1, "as given")
    try:
        plan = plan_fn(model, inventory)
        return Layout(
            plan.tensor_parallel_size,
            plan.pipeline_parallel_size,
            "llmctl plan: " + (plan.reasons[0] if plan.reasons else "chosen layout"),
        )
    except (ConfigError, PlanError) as exc:
        per_node = min(n.gpus for n in inventory.nodes)
        if per_node < 1:
            raise ConfigError(
                f"cannot choose a layout: {exc.message}",
                "declare `gpus:` for every node, or pass -tp and -pp",
            ) from None
        nodes, dp = len(inventory.nodes), data_parallel_size
        why = f"llmctl plan could not decide: {exc.message}"
        if nodes % dp == 0:
            rule = "tp = GPUs per node, pp = nodes" + (f" / {dp} replicas" if dp > 1 else "")
            return Layout(per_node, nodes // dp, f"{rule} ({why})")
        if dp % nodes == 0 and per_node % (dp // nodes) == 0:
            per_replica = per_node // (dp // nodes)
            return Layout(
                per_replica, 1, f"tp = GPUs per node / {dp // nodes} replicas per node ({why})"
            )
        raise ConfigError(
            f"cannot share {nodes} nodes of {per_node} GPUs among {dp} data-parallel replicas "
            f"({why})",
            "pass -tp and -pp for one replica, or a --data-parallel-size that divides the "
            "nodes or their GPUs",
        ) from None


def serve_argv(
    model: str,
    layout: Layout,
    port: int,
    options: Mapping[str, object],
    server: Mapping[str, object] | None = None,
) -> list[str]:
    """`llmctl serve` on the head, listening on every address, on the Ray backend; `options` are
    further EngineArgs keywords (engine_args_to_argv spells them), `server` ServerConfig fields
    (shutdown_timeout, max_request_body_bytes, http_timeout) that differ from their defaults."""
    argv = ["llmctl", "serve", model]
    argv += ["--tensor-parallel-size", str(layout.tensor_parallel_size)]
    argv += ["--pipeline-parallel-size", str(layout.pipeline_parallel_size)]
    argv += ["--distributed-executor-backend", "ray", "--host", "0.0.0.0", "--port", str(port)]
    for name, value in (server or {}).items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv + engine_args_to_argv(options)


def check_cluster_options(options: Mapping[str, object]) -> None:
    """-i derives each node's place in the group from the inventory."""
    given = [name for name in DERIVED_OPTIONS if name in options]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(
            f"{flags}: with -i, every node's place in the group comes from the inventory",
            f"drop {flags}",
        )


def check_group_layout(layout: Layout, nodes: list[NodeSpec]) -> None:
    """The mp backend runs whole pipeline stages on each node of the inventory: P a multiple of
    the nodes, and (where the inventory declares GPUs) a node's ranks fit its GPUs."""
    tp, pp, n = layout.tensor_parallel_size, layout.pipeline_parallel_size, len(nodes)
    if pp % n:
        per_node = min(node.gpus for node in nodes) or tp
        raise ConfigError(
            f"the mp backend runs whole pipeline stages on each of the {n} nodes, but "
            f"pipeline_parallel_size={pp} (tp={tp}) does not divide among them",
            f"pass -pp {n} (or a multiple of {n}) and -tp {per_node} (GPUs per node), or use "
            "the Ray backend",
        )
    per_node = tp * pp // n
    short = [node.host for node in nodes if 0 < node.gpus < per_node]
    if short:
        raise ConfigError(
            f"tp={tp} x pp={pp} puts {per_node} ranks on each of the {n} nodes, but "
            f"{', '.join(short)} declare fewer GPUs",
            "lower -tp, or fix `gpus:` in the inventory",
        )


def node_serve_argvs(
    model: str,
    layout: Layout,
    port: int,
    options: Mapping[str, object],
    server: Mapping[str, object] | None,
    *,
    head_ip: str,
    nnodes: int,
    master_port: int = MASTER_PORT,
) -> list[list[str]]:
    """Each node's `llmctl serve`, node 0 first: the same engine options everywhere, the API
    (and `server`'s ServerConfig fields) on node 0 only, --headless on the others."""
    common = ["llmctl", "serve", model]
    common += ["--tensor-parallel-size", str(layout.tensor_parallel_size)]
    common += ["--pipeline-parallel-size", str(layout.pipeline_parallel_size)]
    common += ["--distributed-executor-backend", "mp", "--nnodes", str(nnodes)]
    common += ["--master-addr", head_ip, "--master-port", str(master_port)]
    engine = engine_args_to_argv(options)
    head = common + ["--node-rank", "0", "--host", "0.0.0.0", "--port", str(port)]
    for name, value in (server or {}).items():
        head += ["--" + name.replace("_", "-"), str(value)]
    argvs = [head + engine]
    for rank in range(1, nnodes):
        argvs.append(common + ["--node-rank", str(rank), "--headless"] + engine)
    return argvs


def serve_steps(
    model: str,
    layout: Layout,
    port: int,
    options: Mapping[str, object],
    server: Mapping[str, object] | None,
    inventory: Inventory,
    backend: str,
    master_port: int = MASTER_PORT,
) -> tuple[RunStep, ...]:
    """Each node's `llmctl serve`, node 0 (the head) first: the one Ray-backend command in the
    head's container, or the mp group's command in every node's (checked first: whole stages
    per node, no option the inventory derives)."""
    if backend != "mp":
        argv = serve_argv(model, layout, port, options, server)
        return (RunStep("serve", tuple(argv), inventory.head.host),)
    check_cluster_options(options)
    options = dict(options)
    master_port = int(options.pop("master_port", master_port))  # type: ignore[arg-type]
    nodes = ordered_nodes(inventory)
    check_group_layout(layout, nodes)
    argvs = node_serve_argvs(
        model, layout, port, options, server,
        head_ip=inventory.head.ip, nnodes=len(nodes), master_port=master_port,
    )  # fmt: skip
    keys = ["serve"] + [f"serve_node_{rank}" for rank in range(1, len(nodes))]
    return tuple(
        RunStep(key, tuple(argv), node.host)
        for key, node, argv in zip(keys, nodes, argvs, strict=True)
    )
