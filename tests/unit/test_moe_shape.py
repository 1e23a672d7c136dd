"""Mixture-of-experts shapes (pure): what ModelShape reads from each family's config.json, how
expert parallelism deals experts out, and what the planner counts per rank."""

from __future__ import annotations

import pytest

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.distributed.partition import describe_expert_placement, expert_shards
from llmctl.engine.errors import ConfigError

COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "intermediate_size": 96,
}


def test_mixtral_experts_are_its_intermediate_size():
    shape = ModelShape.from_hf_config(
        {
            **COMMON,
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        }  # fmt: skip
    )
    assert (shape.num_experts, shape.num_experts_per_tok) == (8, 2)
    assert shape.expert_intermediate_size == 96
    assert not shape.shared_expert_intermediate_size and not shape.qk_norm


def test_qwen2_moe_shared_expert_and_dense_layers():
    shape = ModelShape.from_hf_config(
        {
            **COMMON,
            "model_type": "qwen2_moe",
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }  # fmt: skip
    )
    assert shape.architecture == "Qwen2MoeForCausalLM" and shape.qkv_bias
    assert (shape.expert_intermediate_size, shape.shared_expert_intermediate_size) == (32, 48)
    # Every 2nd layer is sparse (1, 3), except layer 3, kept dense.
    assert [shape.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


def test_qwen3_moe_has_qk_norm_and_no_shared_expert():
    shape = ModelShape.from_hf_config(
        {
            **COMMON,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
        }  # fmt: skip
    )
    assert shape.qk_norm and not shape.qkv_bias
    assert shape.shared_expert_intermediate_size == 0


def test_a_router_choosing_more_experts_than_exist_is_refused():
    with pytest.raises(ConfigError) as err:
        ModelShape.from_hf_config(
            {
                **COMMON,
                "architectures": ["MixtralForCausalLM"],
                "num_local_experts": 2,
                "num_experts_per_tok": 3,
            }  # fmt: skip
        )
    assert "num_experts_per_tok=3" in err.value.message


def test_experts_are_dealt_out_contiguously():
    assert expert_shards(8, 3) == [3, 3, 2]
    assert describe_expert_placement(8, 3) == "experts 0-2 on rank 0, 3-5 on rank 1, 6-7 on rank 2"
    assert describe_expert_placement(3, 3) == "experts 0 on rank 0, 1 on rank 1, 2 on rank 2"
    with pytest.raises(ConfigError) as err:
        expert_shards(8, 16)
    assert "tensor_parallel_size 8 or less" in err.value.hint


def test_plan_counts_every_expert_sliced_or_whole():
    spec = CATALOG["Mixtral-8x7B"]
    inventory = inventory_from_flags(1, 8, 80)
    assert round(spec.total_params() / 1e9, 1) == 46.7  # not one dense MLP: 8 experts
    tp = make_plan(spec, inventory, PlanOptions(tensor_parallel_size=3))
    ep = make_plan(
        spec, inventory, PlanOptions(tensor_parallel_size=3, enable_expert_parallel=True)
    )
    tp_bytes = [r.weight_bytes for r in tp.ranks]
    ep_bytes = [r.weight_bytes for r in ep.ranks]
    # The same model either way; expert parallel holds 3, 3 and 2 whole experts.
    assert abs(sum(tp_bytes) - sum(ep_bytes)) < 2**20
    assert ep_bytes[0] == ep_bytes[1] > tp_bytes[0] > ep_bytes[2]
    assert "--enable-expert-parallel" in ep.commands["serve"]


def test_plan_refuses_expert_parallel_on_a_dense_model():
    with pytest.raises(ConfigError) as err:
        make_plan(
            CATALOG["Llama-3.1-8B"],
            inventory_from_flags(1, 8, 80),
            PlanOptions(enable_expert_parallel=True),
        )
    assert "has no experts" in err.value.message
    assert "--enable-expert-parallel" in err.value.hint


def test_a_mixtral_gguf_is_planned_as_mixtral():
    """llama.cpp writes Mixtral as architecture "llama" with an expert count."""
    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 32,
        "llama.embedding_length": 4096,
        "llama.feed_forward_length": 14336,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": 8,
        "llama.context_length": 32768,
        "llama.vocab_size": 32000,
        "llama.expert_count": 8,
        "llama.expert_used_count": 2,
    }
    shape = ModelShape.from_gguf_metadata(metadata, ("token_embd.weight", "output.weight"))
    assert shape.architecture == "MixtralForCausalLM"
    assert (shape.num_experts, shape.num_experts_per_tok) == (8, 2)
    assert shape.total_params() == CATALOG["Mixtral-8x7B"].total_params()


def test_plan_quantizes_experts_when_float_does_not_fit():
    # Mixtral-8x7B is ~87 GiB in bfloat16: one 80 GiB GPU holds its int8 weights, experts
    # included (the routers stay float), and the serve command says so.
    spec, one_gpu = CATALOG["Mixtral-8x7B"], inventory_from_flags(1, 1, 80)
    plan = make_plan(spec, one_gpu, PlanOptions())
    assert (plan.tensor_parallel_size, plan.quantization) == (1, "int8")
    assert plan.commands["serve"].endswith("--quantization int8")
    params = spec.shape.total_params()
    # a byte per weight and a float32 scale per group of 32; embedding and LM head bfloat16
    assert params * 1.1 < plan.per_gpu_weight_gib * 2**30 < params * 1.15
    int4 = make_plan(spec, one_gpu, PlanOptions(quantization="int4"))
    # half a byte per weight and a float32 scale and zero per group of 32
    assert params * 0.7 < int4.per_gpu_weight_gib * 2**30 < params * 0.78
    # Expert parallel: whole experts per rank, each rank holding its experts' int4 groups.
    ep = make_plan(
        spec,
        inventory_from_flags(1, 2, 24),
        PlanOptions(quantization="int4", enable_expert_parallel=True),
    )
    assert ep.tensor_parallel_size == 2 and ep.per_gpu_weight_gib < 0.55 * int4.per_gpu_weight_gib
