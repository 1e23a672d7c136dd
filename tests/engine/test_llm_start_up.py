"""`from llmctl.engine import LLM` in a plain script shows the engine's start-up lines (the KV-cache
size, the maximum concurrency) on stderr, as vLLM's LLM does, without the caller configuring
logging; a program that configured logging, or LLMCTL_CONFIGURE_LOGGING=0, keeps its own."""

from __future__ import annotations

import json
import os
import shutil
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


VIEW_SCRIPT = """
import json, sys
from llmctl.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
print(json.dumps([list(out[0].outputs[0].token_ids), "transformers" in sys.modules]))
llm.shutdown()
"""


def test_a_second_start_reads_config_json_without_transformers(tiny_models, tmp_path):
    """The first start reads config.json with transformers' AutoConfig (~4 s of CPU here), and
    llmctl keeps what it read; the next start on the same file uses that, imports no transformers
    and gives the same greedy tokens. An edited config.json is read again."""
    model = tmp_path / "model"
    shutil.copytree(tiny_models.path("llama"), model)
    env = {**os.environ, "LLMCTL_CACHE_DIR": str(tmp_path / "cache")}

    def start() -> tuple[list[int], bool]:
        done = subprocess.run(
            [sys.executable, "-c", VIEW_SCRIPT, str(model)],
            capture_output=True, text=True, timeout=300, env=env, check=True,
        )  # fmt: skip
        tokens, imported = json.loads(done.stdout.strip().splitlines()[-1])
        return tokens, imported

    first, imported = start()
    assert imported and len(first) == 8
    assert start() == (first, False)
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 10  # what the model computes
    (model / "config.json").write_text(json.dumps(config))
    edited, imported = start()
    assert imported and len(edited) == 8
    assert start() == (edited, False)


def test_a_dropped_llm_is_collected_in_a_longer_lived_process(tiny_models, monkeypatch):
    """While it runs, the engine keeps its start-up heap (the model, the tokenizer, the engine)
    out of the cyclic garbage collector's walks (gc.freeze, as vLLM does: full collections cost
    a single stream ~2% of its decode); when it shuts down, or its LLM is dropped, that heap is
    the collector's again: a notebook or a test that builds engines one after another gets each
    one's memory back."""
    import gc
    import weakref

    from llmctl.engine import LLM, SamplingParams

    monkeypatch.delenv("LLMCTL_NO_GC_FREEZE")  # the suite's conftest sets it; a user does not
    llm = LLM(tiny_models.path("llama"), use_tqdm_on_load=False, kv_cache_space_gib=0.02)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert gc.get_freeze_count() > 0
    model = weakref.ref(llm.llm_engine.executor.worker.model_runner.model)
    del llm, out
    gc.collect()
    assert model() is None
    assert gc.get_freeze_count() == 0
