"""The executor contract: run a method on every worker (`collective_rpc`) and collect results.

Backends: `uni` (the worker in this process), `mp` (one process per rank) and `ray` (one actor per
rank). `method` is a Worker method's name, or (as in vLLM) a function called on each worker with
the worker first: `collective_rpc(fn, args)` runs `fn(worker, *args)` on every rank. An
EngineConfig without a model config starts bare workers: no device, no distributed environment,
no model; the caller runs `init_device` and what it measures through `collective_rpc` (`llmctl
doctor`'s all-reduce check).

`Executor.get_class` picks a backend as vLLM's documentation says: `mp` when not inside a Ray
placement group and this node has a device for every rank, otherwise `ray`. Ray is imported only
when the Ray backend is used.

`execute_model` only submits a batch and returns a future of its output (the last stage's tp_rank
0 result); the engine's BatchQueue decides how many batches are in flight.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from llmctl.engine import envs
from llmctl.engine.config.engine_config import EngineConfig, ParallelConfig
from llmctl.engine.core.scheduler_output import SchedulerOutput
from llmctl.engine.core.stall_monitor import StalledRanks
from llmctl.engine.distributed import ranks
from llmctl.engine.errors import ConfigError, EngineDeadError

logger = logging.getLogger("llmctl")

# On a CPU-only node, the number of ranks it can host: one per core unless declared.


class Future(Protocol):
    def result(self, timeout: float | None = None) -> Any:
        """One value per rank; past `timeout` seconds the workers are stopped and
        WorkerTimeoutError names the ranks that had not answered."""


class _OutputOf:
    """The future of one rank's value from a collective call's future."""

    def __init__(self, future: Future, rank: int) -> None:
        self.future = future
        self.rank = rank

    def result(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout)[self.rank]


class Done:
    """A future whose value is already known (the uni backend runs synchronously)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value


def run_method(worker: Any, method: str | Callable, args: tuple, kwargs: dict) -> Any:
    """What a worker runs for a call: its method by name, or a function given the worker."""
    if callable(method):
        return method(worker, *args, **kwargs)
    return getattr(worker, method)(*args, **kwargs)


def local_device_count(device: str) -> int:
    """Devices on this node for the backend rule: CUDA devices, or on the CPU the declared
    LLMCTL_CPU_DEVICES (default: the cores this process may use)."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    declared = envs.LLMCTL_CPU_DEVICES
    return declared if declared is not None else len(os.sched_getaffinity(0))


def in_ray_placement_group() -> bool:
    """True inside a Ray task or actor scheduled in a placement group (checked without importing
    Ray when this process is not a Ray worker)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None:  # never imported (or blocked): this process is not a Ray worker
        return False
    from ray.util import get_current_placement_group

    return ray.is_initialized() and get_current_placement_group() is not None


def choose_backend(parallel_config: ParallelConfig, device: str) -> str:
    backend = parallel_config.distributed_executor_backend
    world = parallel_config.world_size
    if backend is None:
        if parallel_config.nnodes > 1:
            backend = "mp"  # across nodes without Ray: each node hosts its own ranks
        elif parallel_config.data_parallel_size > 1:
            backend = "mp"  # each replica its own worker processes (a death is the replica's)
        elif world == 1:
            backend = "uni"
        elif not in_ray_placement_group() and local_device_count(device) >= world:
            backend = "mp"
        else:
            backend = "ray"
    if device == "cuda" and backend != "ray":
        check_local_gpus(parallel_config)
    return backend


def check_local_gpus(parallel_config: ParallelConfig) -> None:
    """The uni and mp backends put every rank on this node, one GPU each: refuse a layout that
    needs more GPUs than it has, before any process starts."""
    pc = parallel_config
    gpus = local_device_count("cuda")
    if pc.ranks_per_node * pc.data_parallel_size <= gpus:
        return
    if pc.data_parallel_size > 1:
        raise ConfigError(
            f"data_parallel_size={pc.data_parallel_size} replicas of {pc.world_size} rank(s) "
            f"need {pc.world_size * pc.data_parallel_size} GPUs, but this node has {gpus}",
            f"lower --data-parallel-size to at most {max(1, gpus // pc.world_size)}",
        )
    nodes = f" on each of {pc.nnodes} nodes" if pc.nnodes > 1 else ""
    raise ConfigError(
        f"tensor_parallel_size={pc.tensor_parallel_size} x pipeline_parallel_size="
        f"{pc.pipeline_parallel_size} needs {pc.ranks_per_node} GPUs{nodes}, but this node "
        f"has {gpus}",
        f"lower -tp/-pp to use at most {gpus} GPU(s), or run on several nodes with "
        "--distributed-executor-backend ray (`llmctl cluster up`, then `llmctl serve -i`)",
    )


class Executor(ABC):
    def __init__(
        self, engine_config: EngineConfig, progress=None, *, start_timeout_s: float | None = None
    ) -> None:
        """`start_timeout_s` bounds the workers' start (None: the backend's own limit); past
        it every worker is stopped and WorkerTimeoutError names the ranks not started."""
        self.engine_config = engine_config
        self.parallel_config = engine_config.parallel_config
        self.start_timeout_s = start_timeout_s
        self.is_dead = False
        # Set from another thread (the server's stall watchdog): what every wait then raises.
        self.abort_error: EngineDeadError | None = None
        self._init_executor(progress)

    @staticmethod
    def get_class(engine_config: EngineConfig) -> type[Executor]:
        backend = choose_backend(engine_config.parallel_config, engine_config.device_config.device)
        if backend == "uni":
            from llmctl.engine.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from llmctl.engine.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        from llmctl.engine.executor.ray import RayExecutor

        return RayExecutor

    @abstractmethod
    def _init_executor(self, progress) -> None: ...

    @abstractmethod
    def collective_rpc_async(
        self, method: str | Callable, args: tuple = (), kwargs: dict | None = None
    ) -> Future:
        """Start `method` on every worker; the future's result is one value per rank."""

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method` on every worker; one result per rank, in rank order. A rank that dies
        or raises stops every worker (WorkerError names it); so does `timeout`."""
        return self.collective_rpc_async(method, args, kwargs).result(timeout)

    @property
    def output_rank(self) -> int:
        pc = self.parallel_config
        return ranks.output_rank(pc.pipeline_parallel_size, pc.tensor_parallel_size)

    def determine_num_available_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future:
        """Start one step on every worker; the future's result is the step's ModelRunnerOutput
        (the sampled tokens, from the last stage's tp_rank 0)."""
        self.check_alive()
        future = self.collective_rpc_async("execute_model", (scheduler_output,))
        return _OutputOf(future, self.output_rank)

    def execute_dummy_batch(self) -> Future:
        """Run a forward of one token of no request on every worker: a data-parallel replica
        with nothing to run keeps step with the others (engine/dp/lockstep.py)."""
        self.check_alive()
        return self.collective_rpc_async("execute_dummy_batch")

    def check_alive(self) -> None:
        if self.abort_error is not None:
            raise self.abort_error
        if self.is_dead:
            raise EngineDeadError(
                "the engine's workers are gone after an earlier failure",
                "start a new LLM (or restart the server)",
            )

    def rank_info(self) -> list[dict]:
        return self.collective_rpc("rank_info")

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    # -- a stalled step, seen from another thread than the engine's -----------------------------

    def stalled_ranks(self) -> StalledRanks | None:
        """The ranks that have not answered the step being waited for, and the stopped worker
        processes; None where the backend cannot tell (uni: the step runs in the caller)."""
        return None

    def abort(self, error: EngineDeadError) -> None:
        """Make the wait in progress, and every later call, raise `error`, and stop the workers
        at once (a stalled group would not answer a graceful shutdown). Any thread may call it."""
        self.abort_error = error
        self.is_dead = True
        self._kill_workers()

    def _kill_workers(self) -> None:  # noqa: B027 - nothing to kill in the caller's process
        """Stop every worker now, from any thread, even one that is stopped (SIGSTOP)."""

    def _raise_if_aborted(self) -> None:
        """In the engine's thread, inside a wait: after abort(), tidy up and raise its error."""
        if self.abort_error is not None:
            self.shutdown()
            raise self.abort_error

    def shutdown(self) -> None:  # noqa: B027 - backends without processes have nothing to stop
        return None
