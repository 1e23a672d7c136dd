"""The all-reduce check across a Ray cluster: one actor per alive node (rank 0 on the head), in a
STRICT_SPREAD placement group; each actor also returns its node's NodeReport.

The actors are stopped (killed, and the group removed) on success, failure or timeout; a timeout
names the ranks that were behind and the stage they were in, which each actor answers while its
`run()` is blocked in a collective. Ray is imported only inside run_on_ray and the actor.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from llmctl.cluster.collective_check import POLL_S, RankJob, run_rank
from llmctl.cluster.collective_report import (
    CollectiveReport,
    RankResult,
    failure_report,
    merge_results,
)
from llmctl.cluster.errors import RayClusterError
from llmctl.cluster.node_facts import NodeReport, collect_local_report, distinct_names
from llmctl.engine.errors import ConfigError
from llmctl.engine.executor.ray import stop_actors


class RayRank:
    """The actor body: one per node. Threaded (max_concurrency=2), so `stage()` answers while
    `run()` is blocked in a collective."""

    def __init__(self) -> None:
        self._stage: str | None = None

    def node_report(self, model: str | None) -> dict:
        import ray

        return collect_local_report(model, ray_ip=ray.util.get_node_ip_address()).to_json()

    def prepare(self) -> bool:
        """Import torch before any timed step: a cold import in a new container takes seconds."""
        import torch.distributed  # noqa: F401

        return True

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, job: RankJob) -> RankResult:
        self._stage = None
        return run_rank(job, self._set_stage)

    def _set_stage(self, name: str) -> None:
        self._stage = name

    def stage(self) -> str | None:
        return self._stage


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
    `ray start` cluster): one actor per alive node, rank 0 on the head, master = the head's
    VLLM_HOST_IP (else its Ray node IP). `backend` "auto" runs Gloo, then NCCL when every node
    has a GPU. `timeout_s` bounds each step (placing the actors, each all-reduce check)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"unknown backend {backend!r}", "use auto, gloo or nccl")
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "Ray is not installed", "pip install 'llmctl[ray]' (or use the llmctl image)"
        ) from None
    connected = _connect(ray)
    pg, actors = None, []
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
        pg, actors = _place(ray, nodes, gpus and "nccl" in backends, timeout_s)
        refs = [a.node_report.remote(model) for a in actors]
        reports = distinct_names([NodeReport.from_json(r) for r in _get(ray, refs, timeout_s)])
        if not collective:
            return RayDoctorRun(tuple(reports))
        _get(ray, [a.prepare.remote() for a in actors], max(timeout_s, 120.0))
        names = [r.node for r in reports]
        master = reports[0].ip or nodes[0]["NodeManagerAddress"]
        port = _get(ray, [actors[0].free_port.remote()], timeout_s)[0]
        results = []
        for name in backends:
            report = _run_ray_backend(ray, actors, name, names, master, port, timeout_s)
            results.append(report)
            if report.error is not None:
                break  # the actors are stuck in a collective: no further backend on them
            port = _get(ray, [actors[0].free_port.remote()], timeout_s)[0]
        return RayDoctorRun(tuple(reports), tuple(results))
    finally:
        stop_actors(actors, pg, connected)


def _connect(ray) -> bool:
    """Join the cluster; True when this call connected (and so disconnects at the end)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as exc:
        raise RayClusterError(
            f"no Ray cluster reachable at {address} ({exc})",
            "run this on a node of the cluster (llmctl cluster up starts one), or set "
            "RAY_ADDRESS=HEAD_IP:6379",
        ) from None
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
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Each node's own `node:IP` resource (capacity 1, never held by the engine) pins bundle i to
    # node i, so the group fits even while the engine holds every CPU.
    bundles = [{f"node:{n['NodeManagerAddress']}": 0.001} for n in nodes]
    if gpu:
        bundles = [dict(b, GPU=1.0) for b in bundles]
    pg = placement_group(bundles, strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        what = "a free GPU on every node" if gpu else "one slot on every node"
        raise RayClusterError(
            f"Ray could not place the doctor's actors ({what}) within {timeout_s:g} s",
            "stop the engine holding the GPUs, or run with --backend gloo"
            if gpu
            else "check `ray status`: every node must be alive",
        )
    actor_class = ray.remote(RayRank)
    actors = [
        actor_class.options(
            num_cpus=0,
            num_gpus=1 if gpu else 0,
            max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(len(nodes))
    ]
    return pg, actors


def _get(ray, refs: list, timeout_s: float) -> list:
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise RayClusterError(
            f"the doctor's actors did not answer within {timeout_s:g} s",
            "check `ray status` and the nodes' load, or raise --timeout",
        ) from None


def _run_ray_backend(
    ray, actors: list, backend: str, names: list[str], master: str, port: int, timeout_s: float
) -> CollectiveReport:
    from ray.exceptions import RayActorError, RayTaskError

    world = len(actors)
    init_method = f"tcp://{master}:{port}"
    refs = [
        actor.run.remote(RankJob(rank, world, init_method, backend, timeout_s))
        for rank, actor in enumerate(actors)
    ]
    index = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, RankResult] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stages = _stages(ray, actors)
            return failure_report(backend, names, stages, master, timeout_s=timeout_s)
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, POLL_S))
        for ref in ready:
            rank = index[ref]
            try:
                results[rank] = ray.get(ref)
            except RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                stages = _stages(ray, actors)
                what = f"raised {type(cause).__name__}: {cause}"
                return failure_report(backend, names, stages, master, rank_error=(rank, what))
            except RayActorError:
                stages = _stages(ray, actors)
                return failure_report(backend, names, stages, master, rank_error=(rank, "died"))
    return merge_results(backend, names, list(results.values()))


def _stages(ray, actors: list) -> list[str | None]:
    stages: list[str | None] = []
    for actor in actors:
        try:
            stages.append(ray.get(actor.stage.remote(), timeout=2.0))
        except Exception:  # dead or unresponsive: its stage is unknown
            stages.append(None)
    return stages
