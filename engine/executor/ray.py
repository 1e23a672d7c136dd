"""RayExecutor: one Ray actor per rank, in one placement group with one bundle per rank.

Ranks follow the mesh of `ranks.reshape(pp, tp)`: a tensor-parallel group is a row and must sit on
one node; pipeline stages may span nodes. Bundles ask for a "GPU" each when the cluster has GPUs
for every rank (real ones, or logical ones declared with `ray start --num-gpus N` on CPU-only
nodes), otherwise for a "CPU". A caller may give its own group (`ParallelConfig.placement_group`,
as in vLLM): rank i's actor then takes the CPUs and GPUs of bundle i, and the group stays the
caller's. Actors keep their node's own environment (VLLM_HOST_IP, NCCL and
Gloo interface variables): nothing of the driver's environment is copied to them.

Data-parallel replicas (`--data-parallel-size N` on this backend) are N RayExecutors in one
process, each with its own placement group, so Ray places each replica where its bundles fit (on
any node of the cluster). They share one connection to Ray (`_RaySession`): the first to start
connects (or starts a private local Ray with a CPU per rank of every replica), the last to stop
disconnects, so a replica that fails and restarts does not take the others' actors down with it.
A rank's torch threads are the node's cores shared out over the ranks of every local replica.

This module is imported only when the Ray backend is chosen; Ray itself is imported here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from llmctl.engine import envs
from llmctl.engine.config.hf_config_view import for_workers
from llmctl.engine.core.stall_monitor import StalledRanks
from llmctl.engine.distributed import ranks
from llmctl.engine.distributed.ports import free_port
from llmctl.engine.distributed.ray_address import check_reachable, find_ray_address
from llmctl.engine.errors import ConfigError, LLMCtlError, WorkerError, WorkerTimeoutError
from llmctl.engine.executor.base import Executor, run_method

logger = logging.getLogger("llmctl")

_POLL_S = 0.5


class RayWorker:
    """The actor body: hosts one Worker and runs its methods by name."""

    def __init__(self) -> None:
        from llmctl.engine import platform

        # before torch loads libgomp: start()'s arguments (the engine config) import it
        platform.passive_openmp_waits()
        self.worker = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port("")  # the master's port: other nodes connect to it

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def start(
        self,
        engine_config,
        rank: int,
        local_rank: int,
        init_method: str,
        threads: int,
        cuda_visible_devices: str | None = None,
    ):
        if cuda_visible_devices is not None:  # before torch's first CUDA call in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        import torch

        from llmctl.engine import platform
        from llmctl.engine.worker.worker import Worker

        torch.set_num_threads(threads)
        self.worker = Worker(engine_config, rank, local_rank, distributed_init_method=init_method)
        if engine_config.model_config is not None:  # else bare: the caller runs init_device
            self.worker.init_device()
            self.worker.load_model()
        platform.freeze_startup_heap()  # (the actor's process ends with the engine)
        return os.getpid()

    def execute_method(self, method: str | Callable, args: tuple, kwargs: dict) -> Any:
        return run_method(self.worker, method, args, kwargs)


class _RayCall:
    def __init__(self, executor: RayExecutor, refs: list) -> None:
        self.executor = executor
        self.refs = refs

    def result(self, timeout: float | None = None) -> list[Any]:
        return self.executor._get(self.refs, timeout=timeout)


class RayExecutor(Executor):
    def _init_executor(self, progress) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = self.parallel_config
        self.world_size = pc.world_size
        self._waiting_on: frozenset[int] = frozenset()  # ranks the engine waits for (_get)
        _SESSION.acquire(self.world_size * pc.data_parallel_size)
        try:
            resource = self._bundle_resource(ray)
            current = pc.placement_group
            if current is None:
                current = ray.util.get_current_placement_group()
            if current is not None:
                pg, self._own_pg = current, False
            else:
                pg = placement_group([{resource: 1.0}] * self.world_size, strategy="PACK")
                self._own_pg = True
        except BaseException:
            _SESSION.release()
            raise
        self.placement_group = pg
        self.actors: list = []
        self._finalizer = weakref.finalize(
            self, stop_actors, self.actors, pg if self._own_pg else None
        )
        try:
            ready, _ = ray.wait([pg.ready()], timeout=envs.LLMCTL_RAY_PLACEMENT_TIMEOUT)
            if not ready:
                raise ConfigError(
                    f"Ray cannot place {self.world_size} workers needing 1 {resource} each: "
                    f"the cluster has {ray.cluster_resources().get(resource, 0):g} {resource}",
                    "add nodes or devices (ray start --num-gpus N declares logical GPUs on CPU "
                    "nodes), or lower tensor_parallel_size x pipeline_parallel_size",
                )
            actor_class = ray.remote(RayWorker)
            options = {"num_cpus": 1.0} if resource == "CPU" else {"num_gpus": 1.0, "num_cpus": 0}
            per_rank = [options] * self.world_size
            if pc.placement_group is not None:
                per_rank = [
                    {"num_cpus": b.get("CPU", 0), "num_gpus": b.get("GPU", 0)}
                    for b in pg.bundle_specs
                ]
            actors = [
                actor_class.options(
                    **per_rank[i],
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i
                    ),
                ).remote()
                for i in range(self.world_size)
            ]
            self.actors.extend(self._order_by_node(ray, actors))
            self._start_workers(ray, progress)
        except BaseException:
            self.shutdown()
            raise

    def _bundle_resource(self, ray) -> str:
        if self.engine_config.device_config.device == "cuda":
            return "GPU"
        return "GPU" if ray.cluster_resources().get("GPU", 0) >= self.world_size else "CPU"

    def _order_by_node(self, ray, actors: list) -> list:
        """Ranks in node order (the driver's node first), so each TP group is on one node."""
        ips = ray.get([a.node_ip.remote() for a in actors])
        driver_ip = ray.util.get_node_ip_address()
        order = sorted(range(len(actors)), key=lambda i: (ips[i] != driver_ip, ips[i]))
        actors = [actors[i] for i in order]
        self.node_ips = [ips[i] for i in order]
        pc = self.parallel_config
        for stage, group in enumerate(
            ranks.tp_groups(pc.pipeline_parallel_size, pc.tensor_parallel_size)
        ):
            nodes = {self.node_ips[r] for r in group}
            if len(nodes) > 1:
                raise ConfigError(
                    f"the tensor-parallel group of pipeline stage {stage} (ranks {group}) would "
                    f"span nodes {sorted(nodes)}",
                    "use tensor_parallel_size <= the devices of one node and add "
                    "--pipeline-parallel-size for the other nodes",
                )
        return actors

    def _start_workers(self, ray, progress) -> None:
        port = ray.get(self.actors[0].free_port.remote())
        init_method = f"tcp://{self.node_ips[0]}:{port}"
        per_node: dict[str, int] = {}
        local_ranks = []
        for ip in self.node_ips:
            local_ranks.append(per_node.get(ip, 0))
            per_node[ip] = per_node.get(ip, 0) + 1
        cores = len(os.sched_getaffinity(0))
        dp = self.parallel_config.data_parallel_size  # replicas sharing this node's cores
        worker_config = for_workers(self.engine_config)  # actors need not import transformers
        visible: list[str | None] = [None] * self.world_size
        if self.engine_config.device_config.device == "cuda":
            gpu_ids = ray.get([a.gpu_ids.remote() for a in self.actors])
            visible = cuda_visible_devices(self.node_ips, gpu_ids)
        refs = [
            actor.start.remote(
                worker_config,
                rank,
                local_ranks[rank],
                init_method,
                max(1, cores // (per_node[self.node_ips[rank]] * dp)),
                visible[rank],
            )
            for rank, actor in enumerate(self.actors)
        ]
        self.pids = self._get(refs, progress=progress, starting=True, timeout=self.start_timeout_s)
        # Bare workers (no model) are a tool's (llmctl doctor), which reports them itself.
        log = logger.info if self.engine_config.model_config is not None else logger.debug
        for rank, (ip, pid) in enumerate(zip(self.node_ips, self.pids, strict=True)):
            log("Ray worker rank %d on node %s, pid %d", rank, ip, pid)

    def collective_rpc_async(
        self, method: str | Callable, args: tuple = (), kwargs: dict | None = None
    ) -> _RayCall:
        import ray

        self.check_alive()
        # Put once; every actor receives the same object (the scheduler output each step).
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs or {})
        refs = [a.execute_method.remote(method, args_ref, kwargs_ref) for a in self.actors]
        return _RayCall(self, refs)

    def _get(
        self, refs: list, progress=None, starting: bool = False, timeout: float | None = None
    ) -> list[Any]:
        """Wait for every rank, failing at the first that dies or raises (no hang on the
        others, which may be blocked in a collective with the dead one), or at `timeout`."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            self._waiting_on = frozenset(index[ref] for ref in pending)
            self._raise_if_aborted()
            poll_s = _POLL_S
            if deadline is not None:
                poll_s = min(poll_s, deadline - time.monotonic())
                if poll_s <= 0:
                    self.is_dead = True
                    self.shutdown()
                    missing = tuple(sorted(index[ref] for ref in pending))
                    raise WorkerTimeoutError(
                        f"Ray worker ranks {list(missing)} did not answer within {timeout:g} s; "
                        "the engine stopped all workers",
                        "check `ray status` and the nodes' load, or allow more time",
                        pending_ranks=missing,
                    )
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
            for ref in ready:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref)
                except RayTaskError as exc:
                    cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                    # Typed errors of start-up, and bad input a worker found later (GPU memory
                    # in the profile step), reach the user as they are.
                    if isinstance(cause, ConfigError) or (
                        starting and isinstance(cause, LLMCtlError)
                    ):
                        self.is_dead = True
                        self.shutdown()
                        raise cause from None
                    self._fail(rank, f"raised {type(cause).__name__}: {cause}")
                except RayActorError as exc:
                    self._fail(rank, f"died ({type(exc).__name__})")
                if progress:
                    progress(len(results), len(refs), "starting workers")
        self._waiting_on = frozenset()
        return [results[r] for r in range(len(refs))]

    def _fail(self, rank: int, what: str) -> None:
        self._raise_if_aborted()  # an actor killed by abort(): its error, not Ray's
        self.is_dead = True
        node = self.node_ips[rank] if rank < len(getattr(self, "node_ips", [])) else "?"
        self.shutdown()
        raise WorkerError(
            f"Ray worker rank {rank} on node {node} {what}; the engine stopped all workers",
            "check that node (memory, `ray status`), then start the engine again",
            rank=rank,
            reason=what,
        )

    def stalled_ranks(self) -> StalledRanks:
        return StalledRanks(tuple(sorted(self._waiting_on)))

    def _kill_workers(self) -> None:
        import ray

        for actor in list(self.actors):
            try:
                ray.kill(actor)
            except Exception:  # already dead
                pass

    def shutdown(self) -> None:
        self._finalizer()


def cuda_visible_devices(node_ips: list[str], gpu_ids: list[list[str]]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each rank (ranks in node order, as _order_by_node leaves them):
    Ray shows an actor only its own GPU, but a rank selects `cuda:<local_rank>`; so every rank
    sees the GPUs Ray gave the ranks of its node, in local-rank order, as vLLM's Ray executor
    does (CUDA IPC between a node's ranks needs it too). Ranks 0-3 on node A given GPUs 2, 0,
    3, 1 and ranks 4-5 on node B given 1, 0: "2,0,3,1" for ranks 0-3 (rank 1, local rank 1,
    uses cuda:1 = GPU 0), "1,0" for ranks 4-5. None for all when a rank has not exactly one
    GPU (a caller's bundles): Ray's own setting stays."""
    if any(len(ids) != 1 for ids in gpu_ids):
        return [None] * len(node_ips)
    per_node: dict[str, list[str]] = {}
    for ip, (gpu,) in zip(node_ips, gpu_ids, strict=True):
        per_node.setdefault(ip, []).append(gpu)
    return [",".join(per_node[ip]) for ip in node_ips]


class _RaySession:
    """This process's connection to Ray, shared by its executors (data-parallel replicas are
    built and stopped at the same time, in their own threads): connected by the first, closed by
    the last, and only if this process connected.

    A private local Ray is started, and stopped, by a thread of its own that lives as long as
    the session: Ray starts its GCS and raylet with PR_SET_PDEATHSIG, which fires when the
    *thread* that started them ends, so a replica's engine thread that started Ray and then
    stopped would take every other replica's actors down with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._thread: threading.Thread | None = None  # set while this process holds Ray
        self._stop = threading.Event()

    def acquire(self, ranks_here: int) -> None:
        import ray

        with self._lock:
            if self._users == 0 and not ray.is_initialized():
                self._start(ranks_here)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0 and self._thread is not None:
                self._stop.set()
                self._thread.join()
                self._thread = None

    def _start(self, ranks_here: int) -> None:
        started: list[BaseException | None] = []
        ready = threading.Event()
        self._stop.clear()

        def hold() -> None:
            import ray

            try:
                _connect_or_start_ray(ranks_here)
                started.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to acquire()
                started.append(exc)
                return
            finally:
                ready.set()
            self._stop.wait()
            ray.shutdown()

        self._thread = threading.Thread(target=hold, name="llmctl-ray", daemon=True)
        self._thread.start()
        ready.wait()
        if started[0] is not None:
            self._thread.join()
            self._thread = None
            raise started[0]


_SESSION = _RaySession()


def _connect_or_start_ray(ranks: int) -> None:
    """Join the cluster RAY_ADDRESS names, or the one `ray start` recorded on this machine (as
    `ray.init()` does; never a raylet merely seen in the process table); else start a private
    local instance with a CPU for each of the `ranks` (at least the machine's cores)."""
    import ray

    found = find_ray_address()
    if found is not None:
        check_reachable(found)
        ray.init(address=found.address, logging_level=logging.WARNING)
        return
    cores = len(os.sched_getaffinity(0))
    ray.init(
        num_cpus=max(cores, ranks),
        include_dashboard=False,
        logging_level=logging.WARNING,
    )


def stop_actors(actors: list, pg) -> None:
    """Kill the actors, remove the placement group, and let go of this process's connection to
    Ray (the last executor to stop closes it); each step tolerates what is already gone."""
    try:
        import ray
        from ray.util.placement_group import remove_placement_group
    except ImportError:
        return
    if not ray.is_initialized():
        _SESSION.release()
        return
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already dead
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:
            pass
    _SESSION.release()
