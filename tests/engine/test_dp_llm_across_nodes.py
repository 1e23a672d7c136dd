"""LLM(...) with vLLM's multi-node data-parallel keywords: the offline engine is the head, with
replica 0 here and replica 1 on a `llmctl serve ... --headless` process (another "node" on
127.0.0.1); a batch is spread over both and its greedy tokens equal one engine's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from support import live_pids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.distributed.ports import free_port

LLMCTL = str(Path(sys.executable).with_name("llmctl"))
TINY = {"dtype": "float32", "kv_cache_space_gib": 0.02}
PROMPTS = [[5, 6, 7], [100, 2000, 30, 4, 900, 12, 77], [42] * 19, [9, 8, 7, 6]]


def test_llm_with_a_replica_on_another_node_matches_one_engine(tiny_models):
    model = str(tiny_models.path("llama"))
    port = free_port()
    node = subprocess.Popen(
        [
            LLMCTL,
            "serve",
            model,
            "--dtype",
            "float32",
            "--kv-cache-space-gib",
            "0.02",
            "-dp",
            "2",
            "--data-parallel-size-local",
            "1",
            "--data-parallel-start-rank",
            "1",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(port),
            "--headless",
            "--rendezvous-timeout",
            "240",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        with LLM(model, use_tqdm_on_load=False, distributed_executor_backend="uni", **TINY) as llm:
            expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        with LLM(
            model,
            use_tqdm_on_load=False,
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=port,
            **TINY,
        ) as llm:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            routed = llm.engine_client.router.routed_count
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert routed[0] > 0 and routed[1] > 0, routed
        out, _ = node.communicate(timeout=60)  # the LLM's shutdown ends the node's replica
        assert node.returncode == 0, out
    finally:
        for pid in live_pids(session=node.pid) | {node.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.wait()
