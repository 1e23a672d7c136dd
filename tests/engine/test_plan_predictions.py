"""The planner against independent counts: catalog weights against transformers' own models (on
the meta device), and, exactly, the KV block count and each rank's weights against a real engine
on every layout the engine tests run."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG
from llmctl.cluster.plan.model_spec import ModelSpec, load_model_spec
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine import LLM
from llmctl.engine.config.engine_config import parse_layer_partition
from llmctl.engine.config.model_shape import ModelShape


def _hf_config(spec: ModelSpec):
    """The Hugging Face config of a catalog entry, built independently of ModelSpec's counting."""
    from transformers import (
        Gemma3TextConfig,
        GPT2Config,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OPTConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    if spec.architecture == "GPT2LMHeadModel":
        return GPT2Config(
            vocab_size=spec.vocab_size,
            n_embd=spec.hidden_size,
            n_layer=spec.num_layers,
            n_head=spec.num_heads,
            n_positions=spec.max_position_embeddings,
        )
    if spec.architecture == "OPTForCausalLM":
        return OPTConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            ffn_dim=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            max_position_embeddings=spec.max_position_embeddings,
            word_embed_proj_dim=spec.hidden_size,
        )
    shape = spec.shape
    if spec.architecture == "MixtralForCausalLM":
        return MixtralConfig(
            **common,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
        )
    moe = dict(
        num_experts=spec.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
    )
    if spec.architecture == "Qwen2MoeForCausalLM":
        shared = shape.shared_expert_intermediate_size
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=shared)
    if spec.architecture == "Qwen3MoeForCausalLM":
        return Qwen3MoeConfig(**common, **moe, head_dim=spec.head_dim)
    if spec.architecture == "Qwen2ForCausalLM":
        return Qwen2Config(**common)
    if spec.architecture == "Qwen3ForCausalLM":
        return Qwen3Config(**common, head_dim=spec.head_dim)
    if spec.architecture == "Phi3ForCausalLM":
        return Phi3Config(**common)
    if spec.architecture == "Gemma3ForCausalLM":  # windows of 1024, every 6th layer global
        return Gemma3TextConfig(
            **common, head_dim=spec.head_dim, sliding_window=1024, query_pre_attn_scalar=168
        )
    if spec.architecture == "GptOssForCausalLM":  # windows of 128 on every other layer
        return GptOssConfig(
            **common,
            head_dim=spec.head_dim,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            sliding_window=128,
        )
    if spec.architecture == "MistralForCausalLM":
        return MistralConfig(**common, head_dim=spec.head_dim)
    return LlamaConfig(**common, head_dim=spec.head_dim)


@pytest.mark.parametrize("name", list(CATALOG))
def test_catalog_weight_memory_matches_the_parameter_count(name):
    from transformers import AutoModelForCausalLM

    spec = CATALOG[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(spec))
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    plan = make_plan(
        spec,
        inventory_from_flags(1, 1, 10_000),
        PlanOptions(max_model_len=1024, dtype="bfloat16", tensor_parallel_size=1),
    )
    assert plan.ranks[0].weight_bytes == params * 2


# Every layout the engine tests run: tp 1/2/3 (9 heads on 3 KV heads: tp=2 deals the KV-head
# groups out 2 + 1), pp 2/3 (4 layers: the default split of pp=3 is 1,2,1) and an uneven
# --pipeline-layer-partition.
LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp3": {"tensor_parallel_size": 3},
    "pp2": {"pipeline_parallel_size": 2},
    "pp3": {"pipeline_parallel_size": 3},
    "pp3-uneven": {"pipeline_parallel_size": 3, "pipeline_layer_partition": "2,1,1"},
}
CASES = (
    [("tiny", layout) for layout in LAYOUTS]
    + [("smollm2", layout) for layout in ("tp1", "tp2", "pp2")]
    # several KV cache groups (sliding layers' blocks freed): shared tensors, per-stage blocks
    + [("gpt-oss", "tp2"), ("gemma3", "pp2")]
)
MODELS = {"tiny": "llama-9-heads", "gpt-oss": "gpt-oss", "gemma3": "gemma3"}


def _engine_kv(caplog, model, **kwargs) -> tuple[int, int, list[int]]:
    """The engine's num_gpu_blocks, the KV cache size it logs (tokens) and each rank's weight
    bytes as loaded."""
    with caplog.at_level(logging.INFO, logger="llmctl"):
        caplog.clear()
        llm = LLM(model, use_tqdm_on_load=False, **kwargs)
        num_blocks = llm.llm_engine.num_blocks
        weights = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
        llm.shutdown()
    match = re.search(r"KV cache size: ([\d,]+) tokens", caplog.text)
    return num_blocks, int(match.group(1).replace(",", "")), weights


@pytest.mark.parametrize(("which", "layout"), CASES, ids=[f"{w}-{lay}" for w, lay in CASES])
def test_plan_predicts_the_engines_kv_block_count_exactly(which, layout, tiny_models, caplog):
    space = 0.05
    model = str(tiny_models.path(MODELS[which])) if which in MODELS else None
    kwargs = LAYOUTS[layout]
    partition = kwargs.get("pipeline_layer_partition")
    plan = make_plan(
        load_model_spec(model),
        inventory_from_flags(1, 2, 1),
        PlanOptions(
            device="cpu",
            kv_cache_space_gib=space,
            max_model_len=256,
            tensor_parallel_size=kwargs.get("tensor_parallel_size"),
            pipeline_parallel_size=kwargs.get("pipeline_parallel_size"),
            pipeline_layer_partition=parse_layer_partition(partition),
        ),
    )
    backend = {"distributed_executor_backend": "mp"} if kwargs else {}
    num_blocks, tokens, weights = _engine_kv(
        caplog, model, kv_cache_space_gib=space, max_model_len=256, **kwargs, **backend
    )
    assert [r.weight_bytes for r in plan.ranks] == weights  # each rank's shard, as loaded
    assert plan.num_kv_blocks == num_blocks
    assert plan.kv_cache_tokens == tokens
    # "KV cache size: N tokens" and "Maximum concurrency ...", as the engine logs them
    assert plan.log_lines()[1] in caplog.text and plan.log_lines()[2] in caplog.text


def test_gguf_file_is_read_like_its_catalog_entry():
    from llmctl.engine.model_loader.default_model import default_model_path

    spec = load_model_spec(str(default_model_path()))
    catalog = CATALOG["SmolLM2-135M-Instruct"]
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads) == (30, 9, 3)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152
    assert spec.total_params() == catalog.total_params()


@pytest.mark.parametrize("name", list(CATALOG))
def test_transformers_configs_give_the_catalog_shape(name):
    """ModelShape.from_hf_config reads transformers' config classes (attribute maps, defaults)
    as the catalog types them in."""
    spec = CATALOG[name]
    assert ModelShape.from_hf_config(_hf_config(spec)) == spec.shape
