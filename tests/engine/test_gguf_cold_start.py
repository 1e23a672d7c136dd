"""The bundled model's first start with an empty LLMCTL_CACHE_DIR (issue 15): no transformers
import, the same prompts' ids and greedy tokens as on the directory transformers wrote, and the
kernels `make setup` built, not compiled again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from gguf_files import (
    transformers_config,
    transformers_tokenizer,
)

from llmctl.engine.model_loader.default_model import default_model_path
from llmctl.engine.model_loader.gguf import _COMPLETE_MARKER, converted_dir


@pytest.fixture(scope="module")
def bundled():
    return default_model_path()


@pytest.fixture(scope="module")
def their_tokenizer(bundled):
    """transformers' conversion of the bundled GGUF's tokenizer (~10 s)."""
    return transformers_tokenizer(bundled)


@pytest.fixture(scope="module")
def their_config(bundled):
    return transformers_config(bundled)


COLD_SCRIPT = """
import json, sys
from llmctl.engine import LLM, SamplingParams
llm = LLM(use_tqdm_on_load=False)  # the bundled GGUF
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
chat = llm.chat([{"role": "user", "content": "Name a fruit."}], params, use_tqdm=False)
text = llm.generate(["Hello, my name is"], params, use_tqdm=False)
out = [chat[0], text[0]]
print(json.dumps([[o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text] for o in out]))
print("transformers" in sys.modules)
"""


def test_cold_start_imports_no_transformers_and_generates_as_before(
    tmp_path, bundled, their_tokenizer, their_config, monkeypatch
):
    """An empty LLMCTL_CACHE_DIR: the GGUF's config and tokenizer are written at start-up. The
    prompts' ids and the greedy tokens equal those of an engine started on the directory
    transformers wrote (what llmctl wrote before)."""
    env = {**os.environ, "LLMCTL_CACHE_DIR": str(tmp_path / "cold")}
    done = subprocess.run(
        [sys.executable, "-c", COLD_SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr
    outputs, imported = done.stdout.strip().splitlines()[-2:]
    assert imported == "False", "the cold start imported transformers"

    from llmctl.engine import LLM, SamplingParams
    from llmctl.engine.model_loader.source import write_config_view

    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "transformers-written"))
    target = converted_dir(bundled)
    target.mkdir(parents=True)
    their_config.save_pretrained(target)
    write_config_view(their_config, target)
    their_tokenizer.save_pretrained(target)
    (target / _COMPLETE_MARKER).write_text(str(bundled))
    llm = LLM(use_tqdm_on_load=False)
    assert llm.llm_engine.config.model_config.path == str(target)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": "Name a fruit."}], params, use_tqdm=False)
    text = llm.generate(["Hello, my name is"], params, use_tqdm=False)
    before = [
        [o.prompt_token_ids, list(o.outputs[0].token_ids), o.outputs[0].text]
        for o in (chat[0], text[0])
    ]
    assert json.loads(outputs) == before


KERNELS_SCRIPT = """
import logging
logging.basicConfig(level=logging.INFO)
from llmctl.engine.kernels.cpu import paged_attention_cpu
from llmctl.engine.kernels.cpu import quantized_matmul as kernels
paged_attention_cpu.build_kernel()
kernels.build_kernel()
"""


def test_a_fresh_cache_dir_loads_the_kernels_make_setup_built(tmp_path, monkeypatch):
    """The kernels `make setup` compiled into torch's extensions directory serve an engine whose
    LLMCTL_CACHE_DIR is new, instead of a ~30 s compile at its first start."""
    from llmctl.engine.kernels.cpu import paged_attention_cpu
    from llmctl.engine.kernels.cpu import quantized_matmul as kernels

    monkeypatch.delenv("LLMCTL_CACHE_DIR", raising=False)
    try:  # what `make setup` does (a cached build returns at once)
        paged_attention_cpu.build_kernel()
        kernels.build_kernel()
    except Exception as exc:  # noqa: BLE001 - no compiler here: nothing was built at setup
        pytest.skip(f"the kernels cannot be built here: {exc}")
    fresh = tmp_path / "fresh"
    env = {**os.environ, "LLMCTL_CACHE_DIR": str(fresh)}
    done = subprocess.run(
        [sys.executable, "-c", KERNELS_SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "Compiling" not in done.stderr
    assert not (fresh / "torch_extensions").exists()
