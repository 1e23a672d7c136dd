"""DPAsyncLLM over scripted engines (the real replicas run in tests/engine and tests/e2e): requests
spread over the replicas; a replica found dead before it took a request sends the request to
another; one that dies mid-stream fails its own requests only; none left is a typed error; one
restarted (--restart-on-failure), or replaced by its node joining again, takes requests again."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from llmctl.engine.client.async_llm import AsyncLLM
from llmctl.engine.core.llm_engine import EngineStats
from llmctl.engine.dp.dp_async_llm import DPAsyncLLM
from llmctl.engine.errors import EngineDeadError, EngineRestartingError
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.sampling_params import SamplingParams

CONFIG = SimpleNamespace(
    cache_config=SimpleNamespace(block_size=4),
    model_config=SimpleNamespace(max_model_len=64),
)


class Replica:
    """Each request yields one token per step for `steps` steps. `dead_on_add`: the worker died
    unnoticed (the next add fails); `fail_on_step`: it dies mid-stream."""

    def __init__(self, steps=3, dead_on_add=False, fail_on_step=None, gate=None) -> None:
        self.config, self.tokenizer = CONFIG, None
        self.steps, self.dead_on_add, self.fail_on_step, self.gate = (
            steps, dead_on_add, fail_on_step, gate
        )  # fmt: skip
        self.requests: dict[str, int] = {}
        self.added: list[str] = []
        self.step_count = 0

    def add_request(self, request_id, prompt, params) -> None:
        if self.dead_on_add:
            raise EngineDeadError("worker rank 0 (pid 1) was killed by SIGKILL")
        self.requests[request_id] = 0
        self.added.append(request_id)

    def abort_request(self, request_id) -> list:
        self.requests.pop(request_id, None)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def release_idle_memory(self) -> None:
        pass

    def check_alive(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        if self.gate is not None:
            self.gate.wait(10)
        self.step_count += 1
        if self.step_count == self.fail_on_step:
            raise EngineDeadError("worker rank 0 (pid 2) was killed by SIGKILL")
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] += 1
            n = self.requests[request_id]
            done = n >= self.steps
            if done:
                del self.requests[request_id]
            completion = CompletionOutput(0, "x", [1] * n, None, None, "length" if done else None)
            outputs.append(RequestOutput(request_id, None, [1], [completion], done))
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0.5, 0, 0, 0, len(self.added), 0)

    def shutdown(self) -> None:
        pass


def dp_of(*engines: Replica) -> DPAsyncLLM:
    return DPAsyncLLM([AsyncLLM(engine) for engine in engines])


async def collect(dp: DPAsyncLLM, prompt: list[int], request_id: str) -> list[RequestOutput]:
    return [o async for o in dp.generate(prompt, SamplingParams(max_tokens=3), request_id)]


def run_all(dp: DPAsyncLLM, prompts: list[list[int]]) -> list:
    async def main():
        tasks = [collect(dp, p, f"r{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


def test_requests_spread_over_the_replicas():
    engines = Replica(), Replica()
    dp = dp_of(*engines)
    results = run_all(dp, [[i, i, i] for i in range(4)])
    assert all(r[-1].finished for r in results)
    assert [len(e.added) for e in engines] == [2, 2]
    assert dp.router.loads == [0, 0]  # every request's work is counted out again
    assert dp.get_stats().prompt_tokens == 4 and dp.get_stats().kv_cache_usage == 0.5
    dp.shutdown()


def test_a_request_reaching_a_dead_replica_runs_on_another():
    engines = Replica(dead_on_add=True), Replica()
    dp = dp_of(*engines)
    [outputs] = run_all(dp, [[1, 2, 3]])
    assert outputs[-1].finished and engines[1].added == ["r0"]
    assert dp.health_error() is None  # one replica serves
    states = dp.replica_states()
    assert states[0][2] is not None and "SIGKILL" in states[0][2].message
    assert states[1][2] is None
    assert "SIGKILL" in dp.router.dead[0]
    dp.shutdown()


def test_a_replica_dying_mid_stream_fails_its_own_requests_only():
    gate = threading.Event()
    engines = Replica(steps=5, fail_on_step=2, gate=gate), Replica(steps=5, gate=gate)
    dp = dp_of(*engines)
    gate.set()
    results = run_all(dp, [[1, 2, 3], [4, 5, 6]])
    assert isinstance(results[0], EngineDeadError) and "pid 2" in results[0].message
    assert results[1][-1].finished
    assert list(dp.router.dead) == [0]
    # the survivor takes what comes next
    later = run_all(dp, [[7, 8, 9]])
    assert later[0][-1].finished and engines[1].added[-1] == "r0"
    dp.shutdown()


def test_no_replica_left_is_a_typed_error_naming_each():
    dp = dp_of(Replica(dead_on_add=True), Replica(dead_on_add=True))
    [result] = run_all(dp, [[1, 2, 3]])
    assert isinstance(result, EngineDeadError)
    error = dp.health_error()
    assert isinstance(error, EngineDeadError) and not dp.is_running
    assert "replica 0: " in error.message and "replica 1: " in error.message
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(dp, [1], "late"))
    dp.shutdown()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_restarted_replica_rejoins_routing_and_health():
    """--restart-on-failure: replica 0's worker dies mid-stream; while it restarts the other
    takes every request and /health is degraded naming the restart; once its new engine serves,
    requests go to both again and /health is ok, counting the restart."""
    gate = threading.Event()
    engines = [Replica(steps=5, fail_on_step=2, gate=gate)]

    def rebuild() -> Replica:
        gate.wait(10)  # the test looks at the replica while it restarts, then lets it finish
        engines.append(Replica())
        return engines[-1]

    first = AsyncLLM(
        engines[0],
        restart_on_failure=True,
        max_restarts=1,
        engine_factory=rebuild,
        restart_backoff_s=0.01,
    )
    survivor = Replica()
    dp = DPAsyncLLM([first, AsyncLLM(survivor)])
    gate.set()
    [failed] = run_all(dp, [[1, 2, 3]])
    assert isinstance(failed, EngineDeadError) and "pid 2" in failed.message

    gate.clear()
    wait_for(lambda: first.restarting is not None and first.restarts == 1)
    while_restarting = run_all(dp, [[i, i] for i in range(4)])
    assert all(r[-1].finished for r in while_restarting) and len(survivor.added) == 4
    states = dp.replica_states()
    assert isinstance(states[0][2], EngineRestartingError)
    assert "restart 1 of 1" in states[0][2].message and "pid 2" in states[0][2].message
    assert states[1][2] is None and dp.health_error() is None  # degraded: one serves

    gate.set()
    wait_for(lambda: first.health_error() is None)
    assert [error for _, _, error in dp.replica_states()] == [None, None]
    assert dp.router.live == [0, 1]
    after = run_all(dp, [[i, i, i] for i in range(10, 14)])
    assert all(r[-1].finished for r in after)
    assert len(engines) == 2 and len(engines[1].added) == 2 and len(survivor.added) == 6
    health = dp.health()
    assert health["status"] == "ok" and health["replicas"][0]["restarts"] == 1
    assert "pid 2" in health["replicas"][0]["last_failure"]
    dp.shutdown()


def test_every_replica_restarting_is_a_retry_later_error():
    gate = threading.Event()

    def rebuild() -> Replica:
        gate.wait(10)
        return Replica()

    dp = DPAsyncLLM(
        [
            AsyncLLM(
                Replica(dead_on_add=True),
                restart_on_failure=True,
                max_restarts=1,
                engine_factory=rebuild,
                restart_backoff_s=0.01,
            )
            for _ in range(2)
        ]
    )
    [result] = run_all(dp, [[1, 2, 3]])
    assert isinstance(result, EngineRestartingError)
    # The request may learn of replica 1's failure before its engine thread reports it: wait
    # until both replicas' health says they restart.
    wait_for(lambda: "replica 1: " in getattr(dp.health_error(), "message", ""))
    error = dp.health_error()
    assert isinstance(error, EngineRestartingError) and "retry" in error.hint
    assert "replica 0: " in error.message and "replica 1: " in error.message
    gate.set()
    wait_for(lambda: dp.health_error() is None)
    [served] = run_all(dp, [[1, 2, 3]])
    assert served[-1].finished
    dp.shutdown()


class Rejoins:
    """The head's join server as DPAsyncLLM sees it: replicas whose node joined again."""

    def __init__(self) -> None:
        self.ready: dict = {}

    def take_rejoined(self) -> dict:
        ready, self.ready = self.ready, {}
        return ready

    def close(self) -> None:
        pass


def test_a_lost_replica_replaced_by_its_rejoined_node_is_routed_to_again():
    engines = Replica(dead_on_add=True), Replica()
    dp = dp_of(*engines)
    dp.join_server = Rejoins()
    run_all(dp, [[1, 2, 3]])  # replica 0 is found dead; its request runs on replica 1
    assert list(dp.router.dead) == [0]
    lost, rejoined = dp.replicas[0], Replica()
    dp.join_server.ready = {0: AsyncLLM(rejoined)}  # its node started again, engine built
    assert [error for _, _, error in dp.replica_states()] == [None, None]
    assert dp.router.dead == {}
    results = run_all(dp, [[4, 5, 6], [7, 8, 9]])
    assert all(r[-1].finished for r in results)
    assert len(rejoined.added) == 1 and dp.replicas[0].engine is rejoined
    dp.shutdown()
    lost.shutdown()
