"""Pipeline stages across nodes burn no CPU while they wait. Two "nodes" on this machine (node 0
is LLM(...) here, node 1 `llmctl serve --headless`, over 127.0.0.1) share its cores, as on the
test bed, so a stage that spins while it waits takes the core the other stage computes on: that
made two nodes at pp=2 10-20x slower than one process group (libgomp's spin-waits; the workers
now wait passively). CPU time is read from /proc, never a throughput: the benchmark
(benchmarks/pp_across_nodes.py) times them."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
from support import VOCAB
from test_multinode import master_port, node_args, reaped, start_headless

from llmctl.engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
WAIT_S = 2.0  # the window over which a waiting stage's CPU time is read


def load_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (24,), generator=g).tolist() for _ in range(16)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_cpu_per_token(llm: LLM) -> tuple[float, list[list[int]]]:
    """The workers' CPU seconds per generated token over one batch, and the tokens."""
    pids = [info["pid"] for info in llm.llm_engine.executor.rank_info()]
    llm.generate(load_prompts()[:2], PARAMS.replace(max_tokens=4), use_tqdm=False)  # warm
    before = sum(cpu_seconds(pid) for pid in pids)
    outputs = llm.generate(load_prompts(), PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    return (sum(cpu_seconds(pid) for pid in pids) - before) / sum(map(len, tokens)), tokens


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_stage_waiting_for_its_input_uses_under_5_percent_of_a_core(tiny_models, monkeypatch):
    # The suite's own passive waits (tests/conftest.py) removed: the processes started here wait
    # as the product makes them, not as the test environment would.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    model = str(tiny_models.path("llama"))
    common = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)
    with LLM(model, pipeline_parallel_size=2, distributed_executor_backend="mp", **common) as llm:
        one_host, expected = worker_cpu_per_token(llm)

    port = master_port()
    with reaped(start_headless(model, port, "-pp", "2")) as node1:
        with LLM(model, pipeline_parallel_size=2, **node_args(port), **common) as llm:
            # Stages that share the cores compute as in one process group: no CPU spent spinning
            # (with libgomp's spin-waits the workers took 10-20x one host's CPU per token).
            across, tokens = worker_cpu_per_token(llm)
            assert tokens == expected
            assert across < 3 * one_host, (across, one_host)

            # Stage 0 stopped mid-batch: stage 1, and its node's agent, wait for it idly.
            stage0, stage1 = (info["pid"] for info in llm.llm_engine.executor.rank_info())
            results: list = []
            batch = threading.Thread(
                target=lambda: results.append(llm.generate(load_prompts(), PARAMS, use_tqdm=False))
            )
            start = cpu_seconds(stage1)
            batch.start()
            wait_for(lambda: cpu_seconds(stage1) > start + 0.05, 60, "stage 1 to compute")
            os.kill(stage0, signal.SIGSTOP)
            try:
                waiting = [(pid, cpu_seconds(pid)) for pid in (stage1, node1.pid)]
                began = time.monotonic()
                time.sleep(WAIT_S)
                elapsed = time.monotonic() - began
                used = {pid: cpu_seconds(pid) - cpu for pid, cpu in waiting}
            finally:
                os.kill(stage0, signal.SIGCONT)
            batch.join(120)
            assert used[stage1] < 0.05 * elapsed, f"stage 1 used {used[stage1]:.3f} s of CPU"
            assert used[node1.pid] < 0.05 * elapsed, f"the agent used {used[node1.pid]:.3f} s"
            assert [o.outputs[0].token_ids for o in results[0]] == expected
        node1.communicate(timeout=60)
