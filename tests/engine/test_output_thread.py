"""Outputs are processed off the engine's step (core/output_thread.py) where the engine runs in
a thread of its own (AsyncLLM: the server's engine): the engine thread only schedules, runs and
updates the scheduler; another thread decodes and delivers. A stop string found there still
ends its sequence in the scheduler (its KV blocks are freed), and the text stops before it, as
when the step processed its own outputs (LLM's in-process engine: tests/engine/test_sampling.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmctl.engine import SamplingParams
from llmctl.engine.client.async_llm import AsyncLLM
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.core.output_processor import OutputProcessor


@pytest.fixture
def async_llm(tiny_models):
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(tiny_models.path("llama")), dtype="float32", device="cpu")
    )
    yield llm
    llm.shutdown()


def _final(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    async def run():
        final = None
        async for output in llm.generate(prompt, params, request_id):
            final = output
        return final

    return asyncio.run(run())


def test_the_engine_thread_never_decodes(async_llm, monkeypatch):
    threads: set[str] = set()
    process = OutputProcessor.process_outputs

    def recording(self, outputs):
        threads.add(threading.current_thread().name)
        return process(self, outputs)

    monkeypatch.setattr(OutputProcessor, "process_outputs", recording)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    output = _final(async_llm, [5, 6, 7], params, "a")
    assert len(output.outputs[0].token_ids) == 12
    assert threads == {"llmctl-outputs"}


def test_a_stop_string_found_off_the_step_ends_the_sequence(async_llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [11, 12, 13]
    full = _final(async_llm, prompt, greedy, "full").outputs[0]
    # a stop string from the middle of the text the model writes
    start = len(full.text) // 2
    stop = full.text[start : start + 3]
    assert stop.strip() and full.text.index(stop) == start
    stopped = _final(async_llm, prompt, greedy.replace(stop=[stop]), "stopped")
    # the engine thread takes the output thread's word with its next commands
    deadline = time.monotonic() + 30
    while async_llm.get_stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert async_llm.get_stats().num_running == 0
    assert async_llm.get_stats().kv_cache_usage == 0.0
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[:start]
    assert len(completion.token_ids) < len(full.token_ids)
