"""`from llmctl.engine import LLM` in a plain script shows the engine's start-up lines (the KV-cache
size, the maximum concurrency) on stderr, as vLLM's LLM does, without the caller configuring
logging; a program that configured logging, or LLMCTL_CONFIGURE_LOGGING=0, keeps its own."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
{setup}
from llmctl.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
llm.shutdown()
"""


def run(path, setup: str = "", **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(setup=setup), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=True,
    )


def test_a_script_sees_the_kv_cache_lines_without_configuring_logging(tiny_models):
    path = tiny_models.path("llama")
    shown = run(path)
    assert shown.stdout.strip() == "2"
    assert "INFO" in shown.stderr and "KV cache size: " in shown.stderr
    assert "Maximum concurrency for 256 tokens per request: 81.88x" in shown.stderr
    assert "KV cache size" not in run(path, LLMCTL_CONFIGURE_LOGGING="0").stderr
    # A program that set up logging its own way gets its format, not a second copy of ours.
    own = run(path, 'import logging; logging.basicConfig(format="mine %(message)s", level=20)')
    assert own.stderr.count("KV cache size") == 1 and "mine KV cache size" in own.stderr
