"""Data-parallel replicas of a planned layout: as many as a node holds, or as many as asked,
on one node or across nodes (vLLM's multi-node data parallel: --data-parallel-size-local and
--headless), and whether replicas can share their experts (expert parallel across DP)."""

from __future__ import annotations

import dataclasses

from llmctl.cluster.errors import PlanError
from llmctl.cluster.inventory import Inventory
from llmctl.cluster.plan.layout_rules import layout_label
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.plan import Plan
from llmctl.cluster.plan.plan_options import PlanOptions
from llmctl.cluster.plan.quantized_fallback import replica_plan
from llmctl.engine.config.engine_args import engine_args_to_argv
from llmctl.engine.config.engine_config import (
    ParallelConfig,
)
from llmctl.engine.errors import ConfigError


def gpu_nodes(inventory: Inventory) -> list:
    """The nodes with GPUs, the head first (it runs the API server and the router)."""
    nodes = [n for n in inventory.nodes if n.gpus]
    return sorted(nodes, key=lambda n: not n.head)


def across_nodes(plan: Plan, nodes: list, per_node: int, reason: str) -> Plan:
    """`per_node` replicas on each of `nodes`: one serve command per node, as vLLM's multi-node
    data parallel runs them (the head's address and RPC port on every node's command)."""
    from llmctl.engine.dp.placement import DEFAULT_RPC_PORT

    replicas = per_node * len(nodes)
    plan = with_replicas(plan, replicas, reason, across_nodes=True)
    one = plan.step("serve")  # a layout of one node: no -i, each node starts its own
    base = {
        "data_parallel_size_local": per_node,
        "data_parallel_address": nodes[0].ip,
        "data_parallel_rpc_port": DEFAULT_RPC_PORT,
    }
    steps = [s for s in plan.steps if s.key != "serve"]
    steps.append(one.with_args(*engine_args_to_argv(base), host=nodes[0].host))
    for i, node in enumerate(nodes[1:], start=1):
        extra = {**base, "data_parallel_start_rank": i * per_node, "headless": True}
        step = one.with_args(*engine_args_to_argv(extra), host=node.host)
        steps.append(dataclasses.replace(step, key=f"serve_node_{i}"))
    return dataclasses.replace(plan, steps=tuple(steps))


def asked_replicas(spec: ModelSpec, inventory: Inventory, options: PlanOptions, dp: int) -> Plan:
    """--data-parallel-size N: one replica planned on a node's GPUs / N; typed errors naming the
    fix when the node cannot hold N replicas or one replica does not fit its share."""
    if options.device == "cpu":
        plan = replica_plan(spec, inventory, options)
        return with_replicas(plan, dp, f"{dp} data-parallel replicas as asked")
    per_node = min((n.gpus for n in inventory.nodes if n.gpus), default=0)
    nodes = gpu_nodes(inventory)
    tp, pp = options.tensor_parallel_size or 1, options.pipeline_parallel_size or 1
    asked = tp * pp
    # replicas that share their experts stay on one node when it holds them
    shared = options.enable_expert_parallel and spec.num_experts and per_node >= dp * asked
    if len(nodes) > 1 and not shared and (dp % len(nodes) == 0 or per_node < dp * asked):
        # spread over the nodes: N / nodes replicas each, none left idle
        return _asked_across_nodes(spec, inventory, options, dp, nodes, per_node)
    if per_node < dp * asked:
        fewer = per_node // asked
        layout = f" of {layout_label(tp, pp)}" if asked > 1 else ""
        raise ConfigError(
            f"data_parallel_size={dp} replicas{layout} need {dp * asked} GPUs on one node, but "
            f"a node of this inventory has {per_node}",
            (f"use --data-parallel-size {fewer} or fewer" if fewer else "use fewer GPUs per "
             "replica (-tp/-pp)") + ", or add nodes to the inventory",
        )  # fmt: skip
    head = nodes[0] if nodes else inventory.nodes[0]

    def on_share(k: int) -> Plan:
        """One replica planned on a node's GPUs / k."""
        node = dataclasses.replace(head, head=True, gpus=per_node // k)
        return replica_plan(spec, dataclasses.replace(inventory, nodes=(node,)), options)

    share = per_node // dp
    try:
        plan = on_share(dp)
    except PlanError as too_big:
        fewer = next((k for k in range(dp - 1, 1, -1) if _fits(on_share, k)), None)
        fix = (
            f"use --data-parallel-size {fewer} or fewer"
            if fewer
            else "drop --data-parallel-size: one replica needs more than a node's GPUs"
        )
        raise PlanError(
            f"data_parallel_size={dp}: one replica gets {share} of a node's {per_node} GPUs, "
            f"and {too_big.message}",
            f"{fix}; {too_big.hint}",
        ) from None
    reason = (
        f"{dp} data-parallel replicas as asked, each on {share} of a node's {per_node} GPUs "
        f"(its layout chosen for those {share}); each its own engine and KV cache"
    )
    return with_replicas(plan, dp, reason)


def _asked_across_nodes(
    spec: ModelSpec, inventory: Inventory, options: PlanOptions, dp: int, nodes: list, per_node: int
) -> Plan:
    """--data-parallel-size N on several GPU nodes: N / nodes replicas on each node (N a multiple
    of the node count), each planned on a node's GPUs / (N / nodes)."""
    tp, pp = options.tensor_parallel_size or 1, options.pipeline_parallel_size or 1
    asked = tp * pp
    capacity = (per_node // asked) * len(nodes)
    if dp % len(nodes) or dp > capacity:
        fits = [k for k in range(len(nodes), capacity + 1, len(nodes))]
        layout = f" of {layout_label(tp, pp)}" if asked > 1 else ""
        raise ConfigError(
            f"data_parallel_size={dp} replicas{layout} do not divide evenly over this "
            f"inventory's {len(nodes)} nodes of {per_node} GPUs"
            if dp <= capacity
            else f"data_parallel_size={dp} replicas{layout} need {dp * asked} GPUs, but this "
            f"inventory's {len(nodes)} nodes have {per_node * len(nodes)}",
            f"use --data-parallel-size {' or '.join(map(str, fits))}"
            if fits
            else "use fewer GPUs per replica (-tp/-pp)",
        )
    local = dp // len(nodes)
    node = dataclasses.replace(nodes[0], head=True, gpus=per_node // local)
    try:
        plan = replica_plan(spec, dataclasses.replace(inventory, nodes=(node,)), options)
    except PlanError as too_big:
        fix = (
            "drop --data-parallel-size: one replica needs more than a node's GPUs"
            if local == 1
            else f"use --data-parallel-size {len(nodes)}"
        )
        raise PlanError(
            f"data_parallel_size={dp}: one replica gets {per_node // local} of a node's "
            f"{per_node} GPUs, and {too_big.message}",
            f"{fix}; {too_big.hint}",
        ) from None
    reason = (
        f"{dp} data-parallel replicas as asked, {local} on each of {len(nodes)} nodes (each on "
        f"{per_node // local} of a node's {per_node} GPUs); node 0 serves the API, the others "
        "join it headless"
    )
    return across_nodes(plan, nodes, local, reason)


def _fits(plan_for, k: int) -> bool:
    try:
        plan_for(k)
    except (PlanError, ConfigError):
        return False
    return True


def shared_experts_error(plan: Plan, replicas: int, across_nodes: bool) -> ConfigError | None:
    """Why `replicas` of `plan` cannot run with --enable-expert-parallel (their MoE layers then
    share the experts over DP x TP ranks: engine/dp/lockstep.py), or None when they can (or do
    not share them)."""
    from llmctl.engine.distributed.partition import expert_shards

    if replicas < 2 or not (plan.serve_args.get("enable_expert_parallel") and plan.num_experts):
        return None
    try:
        ParallelConfig(
            tensor_parallel_size=plan.tensor_parallel_size,
            pipeline_parallel_size=plan.pipeline_parallel_size,
            enable_expert_parallel=True,
            data_parallel_size=replicas,
        )
        expert_shards(plan.num_experts, replicas * plan.tensor_parallel_size)
    except ConfigError as exc:
        return exc
    if across_nodes:
        return ConfigError(
            f"--enable-expert-parallel with --data-parallel-size {replicas} runs every replica "
            "on one node (their MoE layers share the experts); replicas on several nodes are "
            "not supported with it yet",
            "use --data-parallel-size that fits one node, or drop --enable-expert-parallel to "
            "run independent replicas across nodes",
        )
    return None


def with_replicas(plan: Plan, replicas: int, reason: str, across_nodes: bool = False) -> Plan:
    """The plan of one replica, served as `replicas` (the serve command with its flag).
    Raises ConfigError when the replicas cannot share their experts as asked."""
    error = shared_experts_error(plan, replicas, across_nodes)
    if error is not None:
        raise error
    serve = plan.step("serve").with_args(*engine_args_to_argv({"data_parallel_size": replicas}))
    return dataclasses.replace(
        plan,
        data_parallel_size=replicas,
        # each replica its own worker processes, one per rank (engine/executor/base.py)
        distributed_executor_backend="mp"
        if plan.distributed_executor_backend == "uni"
        else plan.distributed_executor_backend,
        reasons=(*plan.reasons, reason),
        steps=tuple(serve if s.key == "serve" else s for s in plan.steps),
    )
