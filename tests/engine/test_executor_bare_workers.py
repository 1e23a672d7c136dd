"""The executors' bare workers (an EngineConfig without a model): the caller joins the world
through collective_rpc; a worker that dies or a call that runs out of time stops every worker
and names the rank, whatever the wall clock."""

from __future__ import annotations

import os
import signal

import pytest
from support import live_pids

from llmctl.engine.config.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from llmctl.engine.errors import EngineDeadError, WorkerError, WorkerTimeoutError
from llmctl.engine.executor.base import Executor


def _bare(world_size: int, **kwargs) -> Executor:
    config = EngineConfig(
        model_config=None,
        cache_config=CacheConfig(),
        scheduler_config=SchedulerConfig(),
        parallel_config=ParallelConfig(
            tensor_parallel_size=world_size, distributed_executor_backend="mp"
        ),
        device_config=DeviceConfig("cpu"),
    )
    return Executor.get_class(config)(config, **kwargs)


def test_bare_workers_join_the_world_without_a_model():
    before = live_pids(parent=os.getpid())
    executor = _bare(2)
    try:
        before_join = executor.rank_info()
        assert [(i["rank"], i["pid"], i["layers"]) for i in before_join] == [
            (0, executor.pids[0], None),
            (1, executor.pids[1], None),
        ]
        # Returns once both ranks joined the world (init_process_group waits for all of them).
        assert executor.collective_rpc("init_device", timeout=60) == [None, None]
    finally:
        executor.shutdown()
    assert live_pids(parent=os.getpid()) - before == set()


def test_a_killed_worker_is_named_and_every_worker_stopped():
    before = live_pids(parent=os.getpid())
    executor = _bare(2)
    executor.collective_rpc("init_device")
    os.kill(executor.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError) as err:
        executor.collective_rpc("check_health")
    assert err.value.rank == 1 and err.value.reason == "was killed by SIGKILL"
    assert "worker rank 1" in err.value.message
    assert live_pids(parent=os.getpid()) - before == set()  # rank 0 was stopped too
    with pytest.raises(EngineDeadError):
        executor.collective_rpc("check_health")


def test_workers_not_started_in_time_are_named_with_the_limit():
    before = live_pids(parent=os.getpid())
    with pytest.raises(WorkerTimeoutError) as err:
        _bare(2, start_timeout_s=0.01)  # no interpreter imports torch within 10 ms
    assert err.value.pending_ranks == (0, 1)
    assert "worker ranks [0, 1]" in err.value.message and "within 0.01 s" in err.value.message
    assert live_pids(parent=os.getpid()) - before == set()
