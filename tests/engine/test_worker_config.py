"""What worker processes receive: the engine config with the model's Hugging Face config as plain
attributes (HFConfigView). It must answer every attribute as the config does, and unpickle in a
fresh interpreter without importing transformers (3.5 s of CPU per worker on 2 cores)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from support import tiny_configs

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.hf_config_view import HFConfigView, for_workers


def _attribute_names(config) -> set[str]:
    names = set(vars(config)) | set(getattr(config, "attribute_map", None) or {})
    for klass in type(config).__mro__:
        names |= {n for n, v in vars(klass).items() if isinstance(v, property)}
    return names


def _plain(value) -> bool:
    return pickle.dumps(value).find(b"transformers") < 0


@pytest.mark.parametrize("family", list(tiny_configs()))
def test_the_view_answers_like_the_config(family):
    config = tiny_configs()[family]
    view = HFConfigView.of(config)
    compared = 0
    for name in sorted(_attribute_names(config)):
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - a property the config itself cannot answer
            continue
        if _plain(value):
            assert getattr(view, name) == value, name
            compared += 1
    assert compared > 20
    # The names the model classes read, aliases included (GPT-2's hidden_size is n_embd), and
    # model_type, a class attribute of each config class (deepseek_v2.py reads it).
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        assert getattr(view, name) == getattr(config, name)
    assert view.model_type == config.model_type
    assert getattr(view, "no_such_attribute", None) is None
    assert HFConfigView.of(view) is view


def test_a_worker_unpickles_its_config_without_transformers(tiny_models):
    engine_config = EngineArgs(model=str(tiny_models.path("gpt2"))).create_engine_config()
    # The config transformers read, or on a later start the view kept of it (source.py)
    original = engine_config.model_config.hf_config
    sent = pickle.dumps(for_workers(engine_config))
    script = (
        "import pickle, sys\n"
        "config = pickle.loads(sys.stdin.buffer.read())\n"
        "model = config.model_config\n"
        "print(model.hidden_size, model.num_attention_heads, model.num_layers,"
        " model.hf_config.n_positions)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], input=sent, capture_output=True, timeout=60, check=True
    )
    sizes, modules = result.stdout.decode().splitlines()
    model = engine_config.model_config
    assert sizes.split() == [str(model.hidden_size), "4", "4", "256"]
    assert modules == "[]"
    assert engine_config.model_config.hf_config is original  # unchanged
