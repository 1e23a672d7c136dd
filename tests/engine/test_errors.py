"""Bad input gets a typed error that says what to change, and the other requests complete."""

from __future__ import annotations

import json
import shutil

import pytest

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import (
    ConfigError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    KVCacheTooSmallError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    RequestBatchError,
    UnsupportedArchitectureError,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(
        str(tiny_models.path("llama")),
        use_tqdm_on_load=False,
        kv_cache_space_gib=0.02,
        max_model_len=64,
    )


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as err:
        LLM(str(missing), use_tqdm_on_load=False)
    assert str(missing) in err.value.message
    assert "never downloads" in err.value.hint


def test_config_without_weights(tmp_path, tiny_models):
    shutil.copy(tiny_models.path("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path), use_tqdm_on_load=False)
    assert "no weights" in err.value.message


def test_corrupt_weights(tmp_path, tiny_models):
    shutil.copytree(tiny_models.path("llama"), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path / "m"), use_tqdm_on_load=False, kv_cache_space_gib=0.01)
    assert "model.safetensors" in err.value.message
    assert "corrupt or truncated" in err.value.hint


def test_corrupt_config(tmp_path, tiny_models):
    shutil.copytree(tiny_models.path("llama"), tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path / "m"), use_tqdm_on_load=False)
    assert "config.json" in err.value.message


def test_weights_of_another_model(tmp_path, tiny_models):
    shutil.copytree(tiny_models.path("llama"), tmp_path / "m")
    shutil.copy(tiny_models.path("qwen2") / "model.safetensors", tmp_path / "m")
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path / "m"), use_tqdm_on_load=False, kv_cache_space_gib=0.01)
    assert "lacks" in err.value.message and "lm_head.weight" in err.value.message


def test_unsupported_architecture(tmp_path, tiny_models):
    shutil.copytree(tiny_models.path("llama"), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as err:
        LLM(str(tmp_path / "m"), use_tqdm_on_load=False)
    assert "LlamaForSequenceClassification" in err.value.message
    for supported in ("LlamaForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM"):
        assert supported in err.value.hint


def test_unknown_dtype(tiny_models):
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, dtype="float8")
    assert "float8" in err.value.message and "bfloat16" in err.value.hint


def test_kv_cache_too_small_for_one_request(tiny_models):
    with pytest.raises(KVCacheTooSmallError) as err:
        LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, kv_cache_space_gib=1e-5)
    assert "max_model_len=256" in err.value.message
    assert "--kv-cache-space-gib" in err.value.hint and "--max-model-len" in err.value.hint


def test_max_model_len_beyond_the_model(tiny_models):
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, max_model_len=100000)
    assert "256" in err.value.message and "--max-model-len 256" in err.value.hint


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("temperature", {"temperature": -0.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -2}),
        ("n", {"n": 0}),
        ("logprobs", {"logprobs": -1}),
        ("repetition_penalty", {"repetition_penalty": 0}),
        ("min_tokens", {"min_tokens": 10, "max_tokens": 5}),
    ],
)
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidSamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field
    assert field in err.value.message
    assert err.value.hint


def test_prompt_too_long_alone(llm):
    with pytest.raises(PromptTooLongError) as err:
        llm.generate([[5] * 64], GREEDY, use_tqdm=False)
    assert "64 tokens" in err.value.message and "max_model_len is 64" in err.value.message


def test_bad_prompts_do_not_stop_the_batch(llm):
    good = [[11, 12, 13], [21, 22, 23, 24, 25]]
    alone = [o.outputs[0].token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)]
    batch = [good[0], [7] * 100, [], good[1], [10**9]]
    with pytest.raises(RequestBatchError) as err:
        llm.generate(batch, GREEDY, use_tqdm=False)
    assert sorted(err.value.errors) == [1, 2, 4]
    assert isinstance(err.value.errors[1], PromptTooLongError)
    assert "empty" in err.value.errors[2].message
    assert "outside the vocabulary" in err.value.errors[4].message
    outputs = err.value.outputs
    assert outputs[1] is None and outputs[2] is None and outputs[4] is None
    assert [outputs[0].outputs[0].token_ids, outputs[3].outputs[0].token_ids] == alone
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_rejects_a_request_while_others_run(llm):
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request("b", [4] * 80, GREEDY)
    with pytest.raises(InvalidRequestError) as dup:
        engine.add_request("a", [1], GREEDY)
    assert "already in use" in dup.value.message
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["a"]
    assert len(finished[0].outputs[0].token_ids) == 8


def test_abort_frees_blocks_and_reports(llm):
    engine = llm.llm_engine
    engine.add_request("x", [3] * 40, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    final = engine.abort_request("x")
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert engine.get_stats().kv_cache_usage == 0
    assert not engine.has_unfinished_requests()


def test_unknown_llm_argument():
    with pytest.raises(ConfigError) as err:
        LLM(use_tqdm_on_load=False, tensor_paralel_size=2)
    assert "tensor_paralel_size" in err.value.message
    assert "tensor_parallel_size" in err.value.hint
