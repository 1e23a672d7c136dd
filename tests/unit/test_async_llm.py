"""AsyncLLM's contract with its callers, on a scripted engine (the real engine's failures are
covered end to end in tests/e2e): whatever raises in the engine thread turns it unhealthy at
once and fails every caller, and a caller that goes away never disturbs the thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmctl.engine.client.async_llm import AsyncLLM
from llmctl.engine.core.llm_engine import EngineStats
from llmctl.engine.errors import EngineDeadError, InvalidRequestError
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.sampling_params import SamplingParams


class ScriptedEngine:
    """Requests produce one output per step until `steps` outputs; `fail_on_step` raises."""

    def __init__(self, steps: int = 3, fail_on_step: int | None = None, gate=None) -> None:
        self.steps = steps
        self.fail_on_step = fail_on_step
        self.gate = gate  # a threading.Event each step waits for, when given
        self.requests: dict[str, int] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.step_count = 0
        self.idle_releases = 0
        self.shut_down = False

    def add_request(self, request_id, prompt, params) -> None:
        if prompt == "bad":
            raise InvalidRequestError("bad prompt", param="prompt")
        if prompt == "bug":
            raise KeyError("a bug on this request's path")
        self.requests[request_id] = 0
        self.added.append(request_id)

    def abort_request(self, request_id) -> list:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def release_idle_memory(self) -> None:
        assert not self.requests, "the heap is given back only once no request is left"
        self.idle_releases += 1

    def check_alive(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        if self.gate is not None:
            self.gate.wait(10)
        self.step_count += 1
        if self.step_count == self.fail_on_step:
            raise RuntimeError("boom")
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


async def collect(llm: AsyncLLM, prompt: str, request_id: str) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, SamplingParams(), request_id)]


def test_requests_run_and_bad_ones_fail_alone():
    engine = ScriptedEngine()
    llm = AsyncLLM(engine)

    async def main():
        good = asyncio.create_task(collect(llm, "p", "a"))
        with pytest.raises(InvalidRequestError):
            await collect(llm, "bad", "b")
        with pytest.raises(KeyError):  # a bug while adding fails that request only
            await collect(llm, "bug", "c")
        return await good

    outputs = asyncio.run(main())
    assert [o.finished for o in outputs] == [False, False, True]
    assert llm.health_error() is None
    llm.shutdown()
    assert engine.shut_down


def test_the_engine_gives_its_heap_back_each_time_its_last_request_finishes():
    """Once per idle spell, after the last request's final output, never between steps."""
    engine = ScriptedEngine(steps=4)
    llm = AsyncLLM(engine)

    def releases_reach(count: int) -> None:
        deadline = time.monotonic() + 10
        while engine.idle_releases < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.idle_releases == count

    asyncio.run(collect(llm, "p", "a"))
    releases_reach(1)
    asyncio.run(collect(llm, "p", "b"))
    releases_reach(2)
    llm.shutdown()
    assert engine.step_count == 8 and engine.idle_releases == 2


def test_an_exception_in_the_engine_thread_fails_everyone_and_health():
    engine = ScriptedEngine(steps=100, fail_on_step=5)
    llm = AsyncLLM(engine)

    async def main():
        results = await asyncio.gather(
            *(collect(llm, "p", f"r{i}") for i in range(3)), return_exceptions=True
        )
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "RuntimeError: boom" in results[0].message
    error = llm.health_error()
    assert isinstance(error, EngineDeadError) and not llm.is_running
    with pytest.raises(EngineDeadError):  # later requests fail at once, never hang
        asyncio.run(collect(llm, "p", "late"))
    assert engine.shut_down


def test_a_caller_cancelled_before_or_while_the_engine_takes_it():
    """Cancelling a caller at any point leaves the engine thread serving, and the request is
    either never added or aborted."""
    gate = threading.Event()
    engine = ScriptedEngine(steps=1000, gate=gate)
    llm = AsyncLLM(engine)

    async def cancel_after(delay_loops: int, request_id: str) -> None:
        task = asyncio.create_task(collect(llm, "p", request_id))
        for _ in range(delay_loops):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        for i in range(200):
            await cancel_after(i % 7, f"c{i}")
        gate.set()
        return await collect(llm, "p", "after")

    engine.steps = 2
    outputs = asyncio.run(main())
    assert outputs[-1].finished
    deadline = 200
    while engine.requests and deadline:  # aborts are posted asynchronously
        threading.Event().wait(0.01)
        deadline -= 1
    assert not engine.requests
    assert set(engine.added) - {"after"} <= set(engine.aborted)
    assert llm.health_error() is None
    llm.shutdown()
