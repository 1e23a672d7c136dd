"""Qwen3, Gemma 3, Phi-3/Phi-4 and gpt-oss shapes (pure): what ModelShape reads from their
config.json and GGUF metadata, what each rank holds, and how the planner counts sliding-window
layers' KV (a sliding layer never holds more than its window and a step's tokens)."""

from __future__ import annotations

import dataclasses

import pytest

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG, find_in_catalog
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError

GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json (the keys ModelShape reads)
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
GEMMA_3_27B = {  # google/gemma-3-27b-it's text_config, as a Gemma3ForCausalLM
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 168,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
}
PHI_4 = {
    "architectures": ["Phi3ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 17920,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 10,
    "vocab_size": 100352,
    "max_position_embeddings": 16384,
    "sliding_window": None,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "config, name",
    [
        (GPT_OSS_20B, "gpt-oss-20b"),
        (GEMMA_3_27B, "Gemma-3-27B"),
        (QWEN3_8B, "Qwen3-8B"),
        (PHI_4, "Phi-4"),
    ],
)
def test_config_json_gives_the_catalog_shape(config, name):
    assert ModelShape.from_hf_config(config) == CATALOG[name].shape


def test_gpt_oss_has_sinks_biased_experts_and_alternating_windows():
    shape = CATALOG["gpt-oss-20b"].shape
    assert shape.attention_sinks and shape.moe_bias and shape.qkv_bias and shape.o_bias
    assert [shape.layer_sliding_window(i) for i in range(3)] == [128, None, 128]
    # the published parameter counts: 20.9B and 116.8B
    assert round(shape.total_params() / 1e9, 1) == 20.9
    assert round(CATALOG["gpt-oss-120b"].total_params() / 1e9, 1) == 116.8


def test_gemma3_global_every_sixth_layer_and_four_norms():
    shape = CATALOG["Gemma-3-27B"].shape
    assert [i for i in range(62) if shape.layer_sliding_window(i) is None] == list(range(5, 62, 6))
    assert shape.tie_word_embeddings and shape.qk_norm
    plain = dataclasses.replace(shape, architecture="LlamaForCausalLM", qk_norm=False)
    # two more RMSNorms per layer, and the q/k norms of one head each
    assert shape.layer_params() - plain.layer_params() == 2 * 5376 + 2 * 128


def test_qwen2_and_qwen3_slide_from_max_window_layers_on():
    config = QWEN3_8B | {
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 30,
    }
    shape = ModelShape.from_hf_config(config)
    assert [shape.layer_sliding_window(i) for i in (29, 30)] == [None, 4096]


def test_bad_layer_types_are_refused():
    with pytest.raises(ConfigError) as err:
        ModelShape.from_hf_config(GPT_OSS_20B | {"layer_types": ["chunked_attention"] * 24})
    assert "layer_types" in err.value.message and err.value.hint


def test_gguf_metadata_of_the_new_architectures():
    gemma = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 62,
        "gemma3.embedding_length": 5376,
        "gemma3.feed_forward_length": 21504,
        "gemma3.attention.head_count": 32,
        "gemma3.attention.head_count_kv": 16,
        "gemma3.attention.key_length": 128,
        "gemma3.context_length": 131072,
        "gemma3.attention.sliding_window": 1024,
        "tokenizer.ggml.tokens": 262208,
    }
    shape = ModelShape.from_gguf_metadata(gemma, ("token_embd.weight",))  # tied
    assert shape == CATALOG["Gemma-3-27B"].shape  # llama.cpp's fixed 1-in-6 pattern
    phi = {
        "general.architecture": "phi3",
        "phi3.block_count": 40,
        "phi3.embedding_length": 5120,
        "phi3.feed_forward_length": 17920,
        "phi3.attention.head_count": 40,
        "phi3.attention.head_count_kv": 10,
        "phi3.context_length": 16384,
        "phi3.attention.sliding_window": 0,  # Phi-4: none
        "tokenizer.ggml.tokens": 100352,
    }
    shape = ModelShape.from_gguf_metadata(phi, ("token_embd.weight", "output.weight"))
    assert shape == CATALOG["Phi-4"].shape


def test_catalog_finds_the_hub_ids():
    assert find_in_catalog("openai/gpt-oss-120b").name == "gpt-oss-120b"
    assert find_in_catalog("Qwen/Qwen3-32B").name == "Qwen3-32B"
    assert find_in_catalog("google/gemma-3-27b-it").name == "Gemma-3-27B"


@pytest.mark.parametrize("name, gain", [("gpt-oss-20b", 1.88), ("Gemma-3-27B", 4.36)])
def test_the_plan_counts_sliding_layers_by_their_window(name, gain):
    """The same model with every layer global holds fewer 131,072-token requests in the same
    memory: a sliding layer holds its window and a step's tokens, not the request."""
    spec = CATALOG[name]
    all_global = dataclasses.replace(
        spec, shape=dataclasses.replace(spec.shape, layer_types=(), sliding_window=None)
    )
    options = PlanOptions(tensor_parallel_size=2)
    inventory = inventory_from_flags(1, 8, 80)
    hybrid, plain = make_plan(spec, inventory, options), make_plan(all_global, inventory, options)
    assert hybrid.kv_layout is not None and plain.kv_layout is None
    assert hybrid.ranks[0].kv_bytes == plain.ranks[0].kv_bytes  # the same memory for the KV
    assert round(hybrid.max_concurrency / plain.max_concurrency, 2) == gain
    assert f"{hybrid.max_concurrency:.2f}x" in hybrid.log_lines()[2]
    assert hybrid.memory_lines()[-1].startswith("KV cache groups: ")
    assert "blocks beyond a sliding window are freed" in hybrid.memory_lines()[-1]
