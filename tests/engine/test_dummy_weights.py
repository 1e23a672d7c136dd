"""--load-format dummy: a model built from its config.json alone (a directory without weights, or a
catalog name), random weights drawn on the device, no checkpoint read; typed errors otherwise."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.errors import (
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
)
from llmctl.engine.model_loader.dummy import HIGH, LOW

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10]]


@pytest.fixture
def config_only(tiny_models, tmp_path):
    """A tiny Llama's directory with config.json and tokenizer, and no weights."""
    source = tiny_models.path("llama")
    target = tmp_path / "config-only"
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def _weights(llm) -> list[torch.Tensor]:
    model = llm.llm_engine.executor.worker.model_runner.model
    return [p for p in model.parameters() if p.numel()]


def test_a_directory_without_weights_runs_with_random_ones(config_only):
    with pytest.raises(ModelLoadError, match="no weights"):
        EngineArgs(model=str(config_only), device="cpu").create_engine_config()

    with LLM(str(config_only), load_format="dummy", dtype="float32", use_tqdm_on_load=False) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        weights = _weights(llm)
        first = outputs[0].outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    assert all(LOW <= float(w.min()) and float(w.max()) <= HIGH for w in weights)
    assert all(float(w.std()) > 0 for w in weights)  # drawn, not filled with a constant

    # the same seed draws the same weights: the same tokens again
    with LLM(str(config_only), load_format="dummy", dtype="float32", use_tqdm_on_load=False) as llm:
        assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first


def test_int8_quantized_dummy_weights_are_packed(config_only):
    with LLM(
        str(config_only),
        load_format="dummy",
        quantization="int8",
        dtype="float32",
        use_tqdm_on_load=False,
    ) as llm:
        model = llm.llm_engine.executor.worker.model_runner.model
        layer = model.model.layers[0].self_attn.qkv_proj
        assert layer.quant_method.parts and layer.quant_method.parts[0].bits == 8
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]


def test_a_mixture_of_experts_from_its_config(tiny_models, tmp_path):
    target = tmp_path / "moe"
    target.mkdir()
    shutil.copy(tiny_models.path("mixtral") / "config.json", target / "config.json")
    with LLM(str(target), load_format="dummy", dtype="float32", use_tqdm_on_load=False) as llm:
        assert llm.llm_engine.tokenizer is None  # no tokenizer files: token ids only
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]


def test_a_catalog_name_is_its_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    config = EngineArgs(
        model="SmolLM2-135M-Instruct", load_format="dummy", device="cpu"
    ).create_engine_config()
    mc = config.model_config
    from llmctl.engine.config.model_catalog import CATALOG

    assert mc.shape == CATALOG["SmolLM2-135M-Instruct"].shape
    assert mc.skip_tokenizer_init  # a catalog entry has no tokenizer
    written = json.loads(
        (tmp_path / "catalog" / "SmolLM2-135M-Instruct" / "config.json").read_text()
    )
    assert written["architectures"] == ["LlamaForCausalLM"]


def test_text_prompts_need_a_tokenizer(tmp_path, tiny_models):
    target = tmp_path / "no-tokenizer"
    target.mkdir()
    shutil.copy(tiny_models.path("llama") / "config.json", target / "config.json")
    with LLM(str(target), load_format="dummy", dtype="float32", use_tqdm_on_load=False) as llm:
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            llm.generate("Hello", GREEDY, use_tqdm=False)


def test_unknown_names_and_formats_are_typed_errors():
    with pytest.raises(ModelNotFoundError, match="catalog") as caught:
        EngineArgs(model="no-such-model", load_format="dummy").create_engine_config()
    assert "--list-models" in caught.value.hint
    with pytest.raises(ConfigError, match="load_format") as caught:
        EngineArgs(load_format="safetensors-please")
    assert "dummy" in caught.value.hint
