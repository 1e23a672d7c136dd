"""Stall detection on a fake clock, the words that name a stall, and the supervision of AsyncLLM
(a stalled engine fails its requests; --restart-on-failure builds a new one) on a scripted
engine. The real executors and processes are covered in tests/e2e/test_stall_health.py."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from llmctl.engine.client.async_llm import AsyncLLM
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.engine_config import ParallelConfig
from llmctl.engine.core.llm_engine import EngineStats
from llmctl.engine.core.stall_monitor import (
    StalledRanks,
    StallMonitor,
    describe_stall,
    proc_state,
    process_state,
    restart_delay,
)
from llmctl.engine.entrypoints.openai.metrics import ServerMetrics
from llmctl.engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineRestartingError,
    EngineStalledError,
)
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_only_an_engine_with_work_and_no_step_for_the_timeout_is_stalled():
    clock = FakeClock()
    monitor = StallMonitor(3.0, clock)
    clock.now += 1000  # idle for long: never stalled
    assert not monitor.stalled() and monitor.seconds_waiting() == 0
    monitor.busy()  # work arrives: counted from now, not from the last step
    clock.now += 2.9
    assert not monitor.stalled() and monitor.seconds_waiting() == pytest.approx(2.9)
    monitor.step_completed()
    assert monitor.last_step_time == clock.now
    clock.now += 2.9
    monitor.busy()  # still waiting for the same step: busy() does not restart the count
    assert not monitor.stalled()
    clock.now += 0.1
    assert monitor.stalled() and monitor.seconds_waiting() == pytest.approx(3.0)
    monitor.step_completed()
    assert not monitor.stalled()
    monitor.idle()
    clock.now += 10
    assert not monitor.stalled()
    assert not StallMonitor(0, clock).stalled()  # 0: off


def test_a_stall_names_the_stopped_rank_and_the_stage_waited_for():
    ranks = StalledRanks(pending_ranks=(2, 3), stopped=((3, 4242, "T"),))
    text = describe_stall(3.14, 3, ranks, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert text == (
        "no engine step completed for 3.1 s (--stall-timeout 3); worker rank 3 (pid 4242) is "
        "stopped (SIGSTOP); ranks [2, 3] (pipeline stage 1) have not answered the current step"
    )
    text = describe_stall(31, 30, None)
    assert text == "no engine step completed for 31.0 s (--stall-timeout 30)"


def test_proc_state_reads_the_field_after_the_command():
    assert proc_state("4242 (python -m x) T 1 4242 4242 0 -1") == "T"
    assert proc_state("7 (a) b) (c) S 1 7") == "S"  # a command with parentheses and spaces
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None


def test_restart_backoff_doubles_up_to_a_cap():
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert restart_delay(20) == 30


def test_options_refuse_impossible_values():
    with pytest.raises(ConfigError, match="--stall-timeout 30"):
        EngineArgs(stall_timeout=-1)
    with pytest.raises(ConfigError, match="--stall-timeout"):
        EngineArgs(stall_timeout=float("nan"))
    with pytest.raises(ConfigError, match="--max-restarts 3"):
        EngineArgs(max_restarts=-1)


# -- AsyncLLM's supervision, on a scripted engine ----------------------------------------------


class FakeExecutor:
    """What AsyncLLM asks of an executor: which ranks are stalled, abort()."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parallel_config = ParallelConfig(tensor_parallel_size=2)
        self.aborted: EngineDeadError | None = None
        self.exited: EngineDeadError | None = None
        self.release_on_abort = True  # False: the step stays stuck until the test opens the gate

    def stalled_ranks(self) -> StalledRanks:
        return StalledRanks((0, 1), ((1, 99, "T"),))

    def abort(self, error: EngineDeadError) -> None:
        self.aborted = error
        if self.release_on_abort:
            self.engine.gate.set()


class Engine:
    """Requests produce one output per step; a step waits for `gate` (a stalled rank) when it
    is cleared, and raises what the executor was aborted with."""

    def __init__(
        self, steps: int = 5, fail_on_step: int | None = None, stall_after: int | None = None
    ) -> None:
        self.steps = steps
        self.fail_on_step = fail_on_step
        self.stall_after = stall_after  # the gate closes after this step (a rank stops)
        self.gate = threading.Event()
        self.gate.set()
        self.executor = FakeExecutor(self)
        self.requests: dict[str, int] = {}
        self.step_count = 0
        self.shut_down = False

    def add_request(self, request_id, prompt, params) -> None:
        self.requests[request_id] = 0

    def abort_request(self, request_id) -> list:
        self.requests.pop(request_id, None)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def release_idle_memory(self) -> None:
        pass

    def check_alive(self) -> None:
        """As the real one: a worker gone while the engine was idle fails it."""
        if self.executor.exited is not None:
            raise self.executor.exited

    def step(self) -> list[RequestOutput]:
        self.gate.wait(30)
        if self.executor.aborted is not None:
            raise self.executor.aborted
        self.step_count += 1
        if self.step_count == self.stall_after:
            self.gate.clear()  # here, not by the test: a fast engine would finish first
        if self.step_count == self.fail_on_step:
            raise EngineDeadError("worker rank 1 (pid 99) was killed by SIGKILL")
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] += 1
            done = self.requests[request_id] >= self.steps
            if done:
                del self.requests[request_id]
            completion = CompletionOutput(0, "x", [1], None, None, "length" if done else None)
            outputs.append(RequestOutput(request_id, "p", [1], [completion], done))
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0)

    def shutdown(self) -> None:
        self.shut_down = True


async def collect(llm: AsyncLLM, request_id: str) -> list[RequestOutput]:
    return [out async for out in llm.generate("p", SamplingParams(), request_id)]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_stalled_step_turns_health_unhealthy_and_fails_the_request():
    engine = Engine(steps=1000, stall_after=2)
    engine.executor.release_on_abort = False  # the workers' end is seen when the test says
    llm = AsyncLLM(engine, stall_timeout=0.3)
    metrics = ServerMetrics(llm, "m")
    assert llm.health_error() is None
    assert 'llmctl:engine_stalled{model_name="m",replica="0"} 0.0' in metrics.render().decode()
    seen: list[str] = []

    async def main():
        task = asyncio.create_task(collect(llm, "a"))
        # the third step never completes by itself (the engine closes the gate after step 2)
        while llm.stall_error is None:
            await asyncio.sleep(0.01)
        seen.append(metrics.render().decode())
        engine.gate.set()  # the aborted step now raises the stall
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(main())
    assert 'llmctl:engine_stalled{model_name="m",replica="0"} 1.0' in seen[0]
    assert 'llmctl:engine_alive{model_name="m",replica="0"} 0.0' in seen[0]
    waited = re.search(
        r'llmctl:seconds_since_last_step\{model_name="m",replica="0"\} (\S+)', seen[0]
    )
    assert float(waited.group(1)) >= 0.3
    assert isinstance(result, EngineStalledError), result
    assert "no engine step completed for" in result.message
    assert "worker rank 1 (pid 99) is stopped (SIGSTOP)" in result.message
    assert result.ranks == (0, 1) and result.stopped == (1,)
    assert engine.executor.aborted is result  # the workers were stopped
    assert llm.health_error() is result  # no restart asked for: dead, saying why
    assert engine.shut_down  # before the request got its error
    llm.shutdown()


def test_restart_on_failure_fails_the_requests_in_flight_then_serves_again():
    engines = [Engine(steps=1000, fail_on_step=3)]
    checked = threading.Event()  # the restart is not done before the test saw it under way

    def factory() -> Engine:
        assert checked.wait(30)
        engines.append(Engine(steps=2))
        return engines[-1]

    llm = AsyncLLM(
        engines[0],
        stall_timeout=5,
        restart_on_failure=True,
        max_restarts=1,
        engine_factory=factory,
        restart_backoff_s=0.2,
    )

    async def main():
        failed = await asyncio.gather(collect(llm, "a"), return_exceptions=True)
        # Restarting: new requests and /health are refused with the reason, at once.
        refused = await asyncio.gather(collect(llm, "b"), return_exceptions=True)
        health = llm.health_error()
        checked.set()
        await asyncio.to_thread(wait_for, lambda: llm.health_error() is None)
        return failed[0], refused[0], health, await collect(llm, "c")

    failed, refused, health, served = asyncio.run(main())
    assert isinstance(failed, EngineDeadError) and "SIGKILL" in failed.message
    assert isinstance(refused, EngineRestartingError)
    assert isinstance(health, EngineRestartingError)
    assert "restart 1 of 1" in health.message and "SIGKILL" in health.message
    assert served[-1].finished
    assert engines[0].shut_down and len(engines) == 2
    assert llm.restarts == 1 and llm.health()["restarts"] == 1
    restarts = 'llmctl:engine_restarts_total{model_name="m",replica="0"} 1.0'
    assert restarts in ServerMetrics(llm, "m").render().decode()
    assert "SIGKILL" in llm.health()["last_failure"]

    # A worker that exits while the engine is idle fails it too; no restarts are left: dead.
    engines[1].executor.exited = EngineDeadError("worker rank 0 (pid 98) exited with code 1")
    wait_for(lambda: llm.dead_error is not None)
    assert "exited with code 1" in llm.health_error().message
    assert engines[1].shut_down
    llm.shutdown()
