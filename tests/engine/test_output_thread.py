"""Outputs are processed off the engine's step (core/output_thread.py): the engine thread only
schedules, runs and updates the scheduler; another thread decodes and delivers. A stop string
found there still ends its sequence in the scheduler (its KV blocks are freed), and the text
stops before it, as when the step processed its own outputs."""

from __future__ import annotations

import threading
import time

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.core.output_processor import OutputProcessor


def test_the_engine_thread_never_decodes(tiny_models, monkeypatch):
    threads: set[str] = set()
    process = OutputProcessor.process_outputs

    def recording(self, outputs):
        threads.add(threading.current_thread().name)
        return process(self, outputs)

    monkeypatch.setattr(OutputProcessor, "process_outputs", recording)
    with LLM(str(tiny_models.path("llama")), dtype="float32", use_tqdm_on_load=False) as llm:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
    assert threads == {"llmctl-outputs"}


def test_a_stop_string_found_off_the_step_ends_the_sequence(tiny_models):
    path = str(tiny_models.path("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(path, dtype="float32", use_tqdm_on_load=False) as llm:
        prompt = [11, 12, 13]
        full = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        # a stop string from the middle of the text the model writes
        start = len(full.text) // 2
        stop = full.text[start : start + 3]
        assert stop.strip() and full.text.index(stop) == start
        stopped = llm.generate([prompt], greedy.replace(stop=[stop]), use_tqdm=False)[0]
        # the engine thread takes the output thread's word with its next commands
        engine = llm.llm_engine
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests()
        assert llm.engine_client.get_stats().kv_cache_usage == 0.0
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[:start]
    assert len(completion.token_ids) < len(full.token_ids)
