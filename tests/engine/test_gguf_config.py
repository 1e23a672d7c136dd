"""A GGUF file's config.json and its view, written without transformers (issue 15, cold start),
give what transformers' GGUF mapping gave where the engine reads them (but for three deliberate
differences, gguf_config.py), and the engine on them generates as transformers does."""

from __future__ import annotations

import json

import pytest
from gguf_files import (
    assert_same_config,
    byte_level_metadata,
    converted,
    llama_shape_keys,
    random_tensors,
    sentencepiece_metadata,
    transformers_config,
    write_gguf,
)

from llmctl.engine.config.hf_config_view import HFConfigView
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.layers.rotary_embedding import rope_parameters
from llmctl.engine.model_loader.default_model import default_model_path
from llmctl.engine.model_loader.gguf import ensure_converted
from llmctl.engine.model_loader.source import CONFIG_VIEW_FILE


@pytest.fixture(scope="module")
def bundled():
    return default_model_path()


@pytest.fixture(scope="module")
def their_config(bundled):
    return transformers_config(bundled)


def test_bundled_config_matches_transformers(smol_dir, their_config):
    assert_same_config(smol_dir, their_config)
    values = json.loads((smol_dir / "config.json").read_text())
    assert values["architectures"] == ["LlamaForCausalLM"]
    assert values["tie_word_embeddings"] is True  # no output.weight in the file
    assert values["max_position_embeddings"] == 8192
    assert (values["bos_token_id"], values["eos_token_id"], values["pad_token_id"]) == (1, 2, 2)


def test_gpt2_gguf_config_matches_transformers(tmp_path, monkeypatch):
    metadata = {
        "{arch}.context_length": 256,
        "{arch}.embedding_length": 64,
        "{arch}.block_count": 2,
        "{arch}.feed_forward_length": 256,
        "{arch}.attention.head_count": 4,
        "{arch}.attention.layer_norm_epsilon": 1e-5,
        **byte_level_metadata("gpt-2"),
    }
    tensors = ("token_embd.weight", "position_embd.weight", "output.weight")
    gguf = write_gguf(tmp_path / "gpt2.gguf", "gpt2", metadata, tensors)
    directory = converted(gguf, monkeypatch, tmp_path / "cache")
    from transformers import AutoConfig

    theirs = transformers_config(gguf)
    view = HFConfigView.from_json((directory / CONFIG_VIEW_FILE).read_text())
    assert ModelShape.from_hf_config(view) == ModelShape.from_hf_config(theirs)
    for name in ("layer_norm_epsilon", "activation_function", "n_positions", "n_embd", "n_layer"):
        assert getattr(view, name) == getattr(theirs, name), name
    # transformers' GGUF mapping adds two keys GPT2Config does not know (n_ctx,
    # feed_forward_length: unread); every other value is the same.
    reread = AutoConfig.from_pretrained(directory).to_dict()
    expected = {
        k: v
        for k, v in theirs.to_dict().items()
        if k not in ("n_ctx", "feed_forward_length", "transformers_version", "_name_or_path")
    }
    for key in ("transformers_version", "_name_or_path"):
        reread.pop(key, None)
    assert reread == expected


def test_mistral_gguf_config_matches_transformers_but_for_the_window(tmp_path, monkeypatch):
    """MistralConfig's default window (4096) is not the file's: a file that states no window
    gets none (llama.cpp applies none), one that states a window gets it."""
    from transformers import AutoConfig

    metadata = {**llama_shape_keys(), **sentencepiece_metadata()}
    gguf = write_gguf(tmp_path / "mistral.gguf", "mistral", metadata, ("token_embd.weight",))
    directory = converted(gguf, monkeypatch, tmp_path / "cache")
    theirs = transformers_config(gguf)
    assert theirs.sliding_window == 4096
    view = HFConfigView.from_json((directory / CONFIG_VIEW_FILE).read_text())
    assert ModelShape.from_hf_config(view).sliding_window is None
    reread = AutoConfig.from_pretrained(directory).to_dict()
    expected = theirs.to_dict()
    assert reread.pop("sliding_window") is None
    expected.pop("sliding_window")
    for key in ("transformers_version", "_name_or_path"):
        reread.pop(key, None)
        expected.pop(key, None)
    assert reread == expected

    metadata["{arch}.attention.sliding_window"] = 64
    gguf = write_gguf(tmp_path / "window.gguf", "mistral", metadata, ("token_embd.weight",))
    view = HFConfigView.from_json((ensure_converted(gguf) / CONFIG_VIEW_FILE).read_text())
    assert ModelShape.from_hf_config(view).sliding_window == 64


def test_linear_rope_scaling_is_kept(tmp_path, monkeypatch):
    """transformers' GGUF mapping drops rope.scaling.*; llama.cpp applies it, and so does llmctl."""
    metadata = {
        **llama_shape_keys(),
        "{arch}.rope.scaling.type": "linear",
        "{arch}.rope.scaling.factor": 4.0,
        **sentencepiece_metadata(),
    }
    gguf = write_gguf(tmp_path / "linear.gguf", "llama", metadata, ("token_embd.weight",))
    directory = converted(gguf, monkeypatch, tmp_path / "cache")
    view = HFConfigView.from_json((directory / CONFIG_VIEW_FILE).read_text())
    assert rope_parameters(view) == {"rope_theta": 500000.0, "rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_engine_on_the_written_config_generates_as_transformers(
    arch, tmp_path, monkeypatch, hf_greedy
):
    """The config written for Qwen2 and GPT-2 GGUF files runs the engine token-exact against
    transformers' own GGUF loader (norm epsilon, rope base, activation, biases, positions)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from llmctl.engine import LLM, SamplingParams

    vocab, hidden, heads, kv_heads, ffn = 96, 32, 4, 2, 64
    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "gpt2":
        # transformers' GGUF mapping for GPT-2 reads no vocab_size, n_inner or n_positions: its
        # loader needs GPT2Config's defaults (4 x hidden, 1024) and the vocabulary's length.
        kv_heads, ffn = heads, 4 * hidden
        tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ġt"]
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_merges(["Ġ t"])
        assert len(tokens) == vocab
    writer.add_context_length(1024 if arch == "gpt2" else 64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(1e-5)
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(100.0)
    writer.add_vocab_size(vocab)
    for name, tensor in random_tensors(arch, vocab, hidden, heads, kv_heads, ffn).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    prompt = [(7 * i + 3) % vocab for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(
        str(path),
        skip_tokenizer_init=True,
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.01,
    ) as llm:
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert out.token_ids == hf_greedy(hf_model.eval(), prompt, 8)
