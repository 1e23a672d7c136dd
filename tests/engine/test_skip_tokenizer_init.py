"""skip_tokenizer_init, as in vLLM: a model without tokenizer files runs on token ids alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import InvalidRequestError, ModelLoadError

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
P = [17, 4021, 388, 9, 1250, 77]  # stops at an EOS id of generation_config.json
Q = [5, 6, 7, 8000, 31000]  # stops at the EOS id of config.json


def _first_new(tokens: list[int], start: int = 2) -> int:
    """The first index from `start` whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def no_tokenizer(tiny_models, tmp_path_factory, hf_greedy):
    """The tiny Llama without its tokenizer files, its EOS ids set to tokens greedy decoding
    reaches: g[k] for P (generation_config.json, a list), h[j] for Q (config.json, an int)."""
    source, hf_model = tiny_models.get("llama")
    path = tmp_path_factory.mktemp("no-tokenizer")
    for name in MODEL_FILES:
        shutil.copy(source / name, path / name)
    g, h = hf_greedy(hf_model, P, 12), hf_greedy(hf_model, Q, 12)
    k, j = _first_new(g), _first_new(h)
    assert g[k] not in h[: j + 1] and h[j] not in g[: k + 1]  # each prompt meets only its EOS
    for name, value in (("generation_config.json", [g[k]]), ("config.json", h[j])):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = value
        (path / name).write_text(json.dumps(data))
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        max_model_len=64,
    )
    return llm, hf_model, path, (g[: k + 1], h[: j + 1])


def test_token_ids_match_transformers_and_there_is_no_text(no_tokenizer, hf_greedy):
    llm, hf_model, _, _ = no_tokenizer
    assert llm.get_tokenizer() is None
    other = [300, 301, 302]
    outputs = llm.generate(
        [P, {"prompt_token_ids": other}], GREEDY.replace(logprobs=2), use_tqdm=False
    )
    for prompt, out in zip([P, other], outputs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(hf_model, prompt, 8)
        assert completion.text == "" and out.prompt is None and out.prompt_token_ids == prompt
        assert len(completion.logprobs) == 8
        for position in completion.logprobs:
            assert len(position) >= 2
            assert all(lp.decoded_token is None and lp.logprob <= 0 for lp in position.values())


def test_eos_ids_come_from_generation_config_and_config_json(no_tokenizer):
    llm, _, _, (stops_p, stops_q) = no_tokenizer
    outputs = llm.generate([P, Q], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for out, expected in zip(outputs, (stops_p, stops_q), strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == expected
        assert completion.finish_reason == "stop" and completion.text == ""


def test_text_prompt_is_refused(no_tokenizer):
    llm, _, _, _ = no_tokenizer
    for prompt in ("Hello", {"prompt": "Hello"}):
        with pytest.raises(InvalidRequestError) as err:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert err.value.param == "prompt"
        assert "skip_tokenizer_init" in err.value.message
        assert "token ids" in err.value.hint


def test_stop_strings_are_refused_but_stop_token_ids_work(no_tokenizer):
    llm, _, _, (stops_p, _) = no_tokenizer
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(P, GREEDY.replace(stop=["a"]), use_tqdm=False)
    assert err.value.param == "stop"
    assert "skip_tokenizer_init" in err.value.message and "stop_token_ids" in err.value.hint
    out = llm.generate(P, GREEDY.replace(stop_token_ids=[stops_p[1]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == stops_p[:2]
    assert out.outputs[0].stop_reason == stops_p[1]


def test_chat_needs_a_tokenizer(no_tokenizer):
    llm, _, _, _ = no_tokenizer
    with pytest.raises(InvalidRequestError) as err:
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert err.value.param == "messages"
    assert "tokenizer" in err.value.message and "skip_tokenizer_init" in err.value.message
    assert not llm.llm_engine.has_unfinished_requests()


def test_without_skip_tokenizer_init_the_hint_names_it(no_tokenizer):
    _, _, path, _ = no_tokenizer
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), use_tqdm_on_load=False, kv_cache_space_gib=0.02)
    assert str(path) in err.value.message
    assert "--skip-tokenizer-init" in err.value.hint


def _write_gguf_without_tokenizer(path, vocab=64, hidden=16, heads=2, kv_heads=1, ffn=32) -> None:
    """A one-layer Llama GGUF with random weights and no tokenizer metadata at all."""
    import gguf

    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "blk.0.attn_q.weight": (heads * head_dim, hidden),
        "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_output.weight": (hidden, heads * head_dim),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
        "output.weight": (vocab, hidden),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.5).astype(np.float32))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_without_a_tokenizer(tmp_path, monkeypatch, hf_greedy):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    _write_gguf_without_tokenizer(gguf_file)
    prompt = [3, 5, 7, 9]
    with LLM(
        str(gguf_file),
        skip_tokenizer_init=True,
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.01,
    ) as llm:
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    assert out.token_ids == hf_greedy(hf_model.eval(), prompt, 8)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(gguf_file), use_tqdm_on_load=False, kv_cache_space_gib=0.01)
    assert "--skip-tokenizer-init" in err.value.hint
