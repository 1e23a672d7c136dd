"""ModelShape: one model shape from config.json, a config object or GGUF metadata (pure)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmctl.cluster.plan.catalog import CATALOG
from llmctl.engine.config.engine_config import check_layout
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
GPT2 = {
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_inner": None,
    "n_positions": 1024,
    "vocab_size": 50257,
}
OPT = {
    "architectures": ["OPTForCausalLM"],
    "hidden_size": 5120,
    "ffn_dim": 20480,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 5120,
}
SMOLLM2_GGUF = {
    "general.architecture": "llama",
    "llama.block_count": 30,
    "llama.context_length": 8192,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "tokenizer.ggml.tokens": ["<unk>"] * 49152,
}


@pytest.mark.parametrize(
    ("config", "catalog"), [(LLAMA, "SmolLM2-135M-Instruct"), (GPT2, "GPT-2"), (OPT, "OPT-13B")]
)
def test_config_json_gives_the_catalog_shape(config, catalog):
    assert ModelShape.from_hf_config(config) == CATALOG[catalog].shape


@pytest.mark.parametrize("config", [LLAMA, GPT2, OPT])
def test_a_config_object_reads_like_its_dict(config):
    assert ModelShape.from_hf_config(SimpleNamespace(**config)) == ModelShape.from_hf_config(config)


def test_model_type_names_the_architecture_when_architectures_is_missing():
    config = {k: v for k, v in LLAMA.items() if k != "architectures"} | {"model_type": "qwen2"}
    shape = ModelShape.from_hf_config(config)
    assert shape.architecture == "Qwen2ForCausalLM" and shape.qkv_bias and not shape.o_bias


def test_sliding_window_only_when_used():
    mistral = LLAMA | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelShape.from_hf_config(mistral).sliding_window == 4096
    qwen2 = mistral | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert ModelShape.from_hf_config(qwen2).sliding_window is None


def test_gguf_metadata_gives_the_same_shape_as_config_json():
    tensors = ("token_embd.weight", "blk.0.attn_q.weight")  # no output.weight: tied
    shape = ModelShape.from_gguf_metadata(SMOLLM2_GGUF, tensors)
    assert shape == ModelShape.from_hf_config(LLAMA)
    untied = ModelShape.from_gguf_metadata(SMOLLM2_GGUF, (*tensors, "output.weight"))
    assert not untied.tie_word_embeddings
    counted = SMOLLM2_GGUF | {"tokenizer.ggml.tokens": 49152}  # an array given by its length
    assert ModelShape.from_gguf_metadata(counted, tensors) == shape


def test_unsupported_gguf_architecture():
    with pytest.raises(ConfigError) as err:
        ModelShape.from_gguf_metadata({"general.architecture": "mamba"})
    assert "mamba" in err.value.message and "llama" in err.value.hint


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 2}, "9 attention heads are not a multiple of 2 KV heads"),
        ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
        ({"num_hidden_layers": 0}, "num_layers must be a positive integer, got 0"),
        ({"architectures": ["MambaForCausalLM"]}, "'MambaForCausalLM' has no known shape"),
    ],
)
def test_impossible_shapes_are_refused_with_a_typed_error(change, message):
    with pytest.raises(ConfigError) as err:
        ModelShape.from_hf_config(LLAMA | change)
    assert message in err.value.message
    assert err.value.hint


def test_per_rank_weights_follow_the_layers_partitions():
    shape = ModelShape.from_hf_config(LLAMA)  # 9 heads on 3 KV heads
    h, d = shape.hidden_size, shape.head_dim
    # tp=2 deals whole KV-head groups: 2 groups (6 query heads) and 1 group (3 query heads).
    assert [(s.num_q_heads, s.num_kv_heads) for s in shape.tensor_parallel_heads(2)] == [
        (6, 2),
        (3, 1),
    ]
    assert shape.layer_params(0, 2) - shape.layer_params(1, 2) == (
        h * (3 * d + 2 * d) + 3 * d * h  # one more KV-head group's q, k, v and o columns
    )
    # Split matrices add up; each rank keeps its own copy of the two RMSNorms.
    assert shape.layer_params(0, 2) + shape.layer_params(1, 2) == shape.layer_params() + 2 * h
    # The vocabulary (49152) splits 16384 x 3; an LM head off the embedding's stage is its own.
    assert shape.embedding_params(2, 3) == 16384 * h
    assert shape.head_params(2, 3, with_embedding=False) == h + 16384 * h


def test_kv_block_bytes_per_rank():
    shape = ModelShape.from_hf_config(LLAMA)
    per_layer = 2 * shape.head_dim * 4 * 16  # K and V, float32, 16 tokens
    assert shape.kv_cache_bytes_per_block(15, 0, 1, 4, 16) == 15 * 3 * per_layer
    assert shape.kv_cache_bytes_per_block(30, 0, 2, 4, 16) == 30 * 2 * per_layer
    assert shape.kv_cache_bytes_per_block(30, 1, 2, 4, 16) == 30 * 1 * per_layer


def test_check_layout_reads_the_shape():
    shape = ModelShape.from_hf_config(LLAMA)
    check_layout(shape, 2, 3, (10, 10, 10))
    with pytest.raises(ConfigError) as err:
        check_layout(shape, 10, 1, None)
    assert "cannot split 9 attention heads (3 KV heads)" in err.value.message
    with pytest.raises(ConfigError) as err:
        check_layout(shape, 1, 2, (10, 10))
    assert "give 2 positive numbers that sum to 30" in err.value.hint
