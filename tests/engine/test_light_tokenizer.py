"""The bundled model starts without transformers: LightTokenizer and the saved config view answer
as AutoTokenizer and AutoConfig do (issue 15: start-up time and peak RSS)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest
from transformers import AutoConfig

from llmctl.engine.config.hf_config_view import HFConfigView
from llmctl.engine.tokenizer.light_tokenizer import LightTokenizer
from llmctl.engine.tokenizer.tokenizer import get_tokenizer

TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "héllo 😀 ünïcode\n\ttabs\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "Don't stop , ok ? I 'm sure .",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2? {{ not a template }}"},
    ],
]


@pytest.fixture(scope="module")
def both(smol_dir, smol_tokenizer):
    light = get_tokenizer(str(smol_dir))
    assert isinstance(light, LightTokenizer)
    return light, smol_tokenizer


def test_ids_text_and_special_tokens_match_transformers(both):
    light, hf = both
    for text in TEXTS:
        for add in (True, False):
            assert light.encode(text, add_special_tokens=add) == hf.encode(
                text, add_special_tokens=add
            )
        ids = hf.encode(text)
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    assert light.eos_token_id == hf.eos_token_id
    assert light.get_vocab() == hf.get_vocab()


def test_chat_template_renders_as_transformers(both):
    light, hf = both
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
            assert light.apply_chat_template(conversation, **kw) == hf.apply_chat_template(
                conversation, **kw
            )
        assert light.apply_chat_template(conversation) == hf.apply_chat_template(
            conversation, tokenize=True, return_dict=False
        )


def test_directories_it_does_not_model_go_to_transformers(smol_dir, tmp_path):
    extra = tmp_path / "extra"
    shutil.copytree(smol_dir, extra)
    (extra / "special_tokens_map.json").write_text("{}")
    assert LightTokenizer.load(extra) is None
    assert not isinstance(get_tokenizer(str(extra)), LightTokenizer)

    other = tmp_path / "other"
    shutil.copytree(smol_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizer"  # transformers adds its own behaviour
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert LightTokenizer.load(other) is None


def test_saved_config_view_answers_as_the_config(smol_dir):
    config = AutoConfig.from_pretrained(smol_dir)
    view = HFConfigView.from_json(HFConfigView.of(config).to_json())
    for name in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(view, name) == getattr(config, name)
    assert view.dtype == config.dtype
    assert view.architectures == config.architectures


def test_bundled_model_generates_without_importing_transformers(smol_dir):
    # smol_dir: the GGUF's config and tokenizer are written (test_gguf_cold_start.py checks that
    # the first run, which writes them, imports no transformers either)
    script = (
        "import sys\n"
        "from llmctl.engine import LLM, SamplingParams\n"
        "llm = LLM(use_tqdm_on_load=False)\n"  # the bundled GGUF
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print(repr(out[0].outputs[0].text))\n"
        "print('transformers' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    text, imported = done.stdout.strip().splitlines()[-2:]
    assert text not in ("''", "")
    assert imported == "False", "the bundled model's start-up imported transformers"


def test_encoding_a_long_text_lets_other_threads_run(both):
    """The server tokenizes in a thread pool: a 5 MB prompt must not hold the GIL (the event
    loop, /health included, runs meanwhile)."""
    light, _ = both
    text = "hello world, " * 400_000
    ticks = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.perf_counter()
        light.encode(text)
        took = time.perf_counter() - start
    finally:
        done.set()
        ticker.join()
    during = [t for t in ticks if start <= t <= start + took]
    assert len(during) > 10 * took, f"{len(during)} ticks in {took:.2f} s of encoding"
