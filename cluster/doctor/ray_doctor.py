"""The all-reduce check across a Ray cluster: one rank per alive node (rank 0 on the driver's
node, normally the head), each a bare worker the Ray executor starts in the doctor's placement
group; each rank also returns its node's NodeReport.

The doctor decides where ranks go (one bundle pinned to each node, STRICT_SPREAD) and what they
measure (collective_check); the Ray executor starts the actors, fails at the first that dies or
raises or at the deadline, and stops them, as it does for the engine. The group is removed at the
end, however the check ends. Ray is imported only inside run_on_ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from llmctl.cluster.doctor.collective_check import check_config, run_check, start_workers
from llmctl.cluster.doctor.collective_report import CollectiveReport
from llmctl.cluster.doctor.node_facts import NodeReport, collect_local_report, distinct_names
from llmctl.cluster.errors import RayClusterError
from llmctl.engine.distributed.ray_address import check_reachable, find_ray_address
from llmctl.engine.errors import ConfigError, WorkerTimeoutError

# Starting an actor imports torch: seconds in a new container, before any timed step.
START_TIMEOUT_S = 120.0


def node_report(worker: Any, model: str | None) -> dict:
    """Run on each rank's worker: its node's report."""
    import ray

    return collect_local_report(model, ray_ip=ray.util.get_node_ip_address()).to_json()


@dataclass(frozen=True)
class RayDoctorRun:
    """What run_on_ray found: each node's report (head first) and one report per backend."""

    reports: tuple[NodeReport, ...]
    collectives: tuple[CollectiveReport, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": [r.to_json() for r in self.reports],
            "collectives": [c.to_json() for c in self.collectives],
        }


def run_on_ray(
    timeout_s: float = 60.0,
    backend: str = "auto",
    *,
    model: str | None = None,
    collective: bool = True,
) -> RayDoctorRun:
    """The check across the Ray cluster this process reaches (RAY_ADDRESS, else the local
    `ray start` cluster): one rank per alive node, the master on rank 0's node. `backend` "auto"
    runs Gloo, then NCCL when every node has a GPU. `timeout_s` bounds each step (placing the
    ranks, the reports, each all-reduce check)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"unknown backend {backend!r}", "use auto, gloo or nccl")
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "Ray is not installed", "pip install 'llmctl[ray]' (or use the llmctl image)"
        ) from None
    connected = _connect(ray)
    pg = executor = None
    try:
        nodes = _alive_nodes(ray)
        # Real GPUs: Ray adds an accelerator_type:NAME resource where it detects them; logical
        # ones (`ray start --num-gpus N` on CPU-only nodes, as in tests) have none: no NCCL.
        gpus = all(
            n["Resources"].get("GPU", 0) >= 1
            and any(k.startswith("accelerator_type:") for k in n["Resources"])
            for n in nodes
        )
        backends = {"auto": ["gloo"] + (["nccl"] if gpus else []), "gloo": ["gloo"]}.get(
            backend, ["nccl"]
        )
        if "nccl" in backends and not gpus:
            raise ConfigError(
                "the NCCL check needs a GPU on every node; some Ray nodes have none",
                "use --backend gloo",
            )
        pg = _place(ray, nodes, gpus and "nccl" in backends, timeout_s)
        executor = _start(backends[0], len(nodes), pg, max(timeout_s, START_TIMEOUT_S))
        reports = distinct_names(
            [NodeReport.from_json(r) for r in _rpc(executor, node_report, (model,), timeout_s)]
        )
        if not collective:
            return RayDoctorRun(tuple(reports))
        names = [r.node for r in reports]
        master = executor.node_ips[0]
        results = []
        for i, name in enumerate(backends):
            if i == 0:
                first, executor = executor, None  # run_check stops it

                def start(_timeout: float, first=first):
                    return first
            else:

                def start(timeout: float, name=name):
                    return _start(name, len(nodes), pg, timeout)

            report = run_check(start, name, names, master, timeout_s)
            results.append(report)
            if report.error is not None:
                break
        return RayDoctorRun(tuple(reports), tuple(results))
    finally:
        if executor is not None:
            executor.shutdown()
        _remove(ray, pg)
        if connected:
            ray.shutdown()


def _start(backend: str, world_size: int, pg, timeout_s: float):
    """The Ray executor's bare workers, rank i in bundle i of the doctor's group."""
    config = check_config(world_size, backend, "ray", placement_group=pg)
    try:
        return start_workers(config, timeout_s)
    except WorkerTimeoutError:
        raise _no_answer(timeout_s) from None


def _rpc(executor, method, args: tuple, timeout_s: float) -> list:
    try:
        return executor.collective_rpc(method, args, timeout=timeout_s)
    except WorkerTimeoutError:
        raise _no_answer(timeout_s) from None


def _no_answer(timeout_s: float) -> RayClusterError:
    return RayClusterError(
        f"the doctor's actors did not answer within {timeout_s:g} s",
        "check `ray status` and the nodes' load, or raise --timeout",
    )


_JOIN_HINT = (
    "run it where the cluster's `ray start` ran: inside a node's container (`llmctl doctor -i "
    "cluster.yaml` does that from your machine), or set RAY_ADDRESS=HEAD_IP:6379"
)


def _connect(ray) -> bool:
    """Join the cluster; True when this call connected (and so disconnects at the end)."""
    if ray.is_initialized():
        return False
    found = find_ray_address()
    if found is None:
        raise RayClusterError(
            "no Ray cluster here: RAY_ADDRESS is not set and no `ray start` ran on this machine",
            _JOIN_HINT,
        )
    try:
        check_reachable(found)
    except ConfigError as exc:
        raise RayClusterError(exc.message, exc.hint) from None
    try:
        ray.init(address=found.address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as exc:
        message = f"no Ray cluster reachable at {found.address} ({exc})"
        raise RayClusterError(message, _JOIN_HINT) from None
    return True


def _alive_nodes(ray) -> list[dict]:
    """Alive nodes, the head first, the others by IP."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    # A node whose container was just recreated can be listed twice (the old raylet is not yet
    # marked dead): one bundle per address, which `node:IP` places on the live one.
    nodes = list({n["NodeManagerAddress"]: n for n in nodes}.values())
    return sorted(
        nodes,
        key=lambda n: (
            "node:__internal_head__" not in n.get("Resources", {}),
            n["NodeManagerAddress"],
        ),
    )


def _place(ray, nodes: list[dict], gpu: bool, timeout_s: float):
    from ray.util.placement_group import placement_group

    # Each node's own `node:IP` resource (capacity 1, never held by the engine) pins bundle i to
    # node i, so the group fits even while the engine holds every CPU.
    bundles = [{f"node:{n['NodeManagerAddress']}": 0.001} for n in nodes]
    if gpu:
        bundles = [dict(b, GPU=1.0) for b in bundles]
    pg = placement_group(bundles, strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        _remove(ray, pg)
        what = "a free GPU on every node" if gpu else "one slot on every node"
        raise RayClusterError(
            f"Ray could not place the doctor's actors ({what}) within {timeout_s:g} s",
            "stop the engine holding the GPUs, or run with --backend gloo"
            if gpu
            else "check `ray status`: every node must be alive",
        )
    return pg


def _remove(ray, pg) -> None:
    if pg is None or not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # already gone
        pass
