"""DeepSeek-V3 / Kimi-K2 / GLM-4.5 shapes and block FP8's rules, pure: what ModelShape reads from
their config.json, the latent KV cache per token, which tensor-parallel sizes keep whole FP8
blocks (Qwen3-235B-A22B-FP8's 1536-feature experts do not split 8 ways), and the FP8 errors."""

from __future__ import annotations

import pytest

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine.errors import ConfigError, UnsupportedQuantizationError
from llmctl.engine.layers.quantization.fp8 import block_cuts, check_block_split, check_fp8_device
from llmctl.engine.layers.quantization.quant_config import QuantizationConfig


def test_deepseek_v3_reads_as_multi_head_latent_attention():
    shape = CATALOG["DeepSeek-V3"].shape
    assert shape.is_mla and (shape.kv_lora_rank, shape.qk_rope_head_dim) == (512, 64)
    assert shape.head_dim == 192 and shape.num_kv_heads == shape.num_attention_heads == 128
    assert [shape.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert shape.shared_expert_intermediate_size == 2048 and not shape.shared_expert_gate
    assert shape.expert_score_bias
    # the latent and the rope key, whole on every tensor-parallel rank
    assert shape.kv_bytes_per_token(61, 3, 8, 2) == 61 * (512 + 64) * 2
    assert round(shape.total_params() / 1e9) == 671


def test_kimi_k2_and_glm_4_5():
    kimi = CATALOG["Kimi-K2"].shape
    assert kimi.architecture == "DeepseekV3ForCausalLM" and kimi.num_experts == 384
    assert round(kimi.total_params() / 1e9) == 1026
    glm = CATALOG["GLM-4.5"].shape
    assert glm.qk_norm and glm.qkv_bias and not glm.o_bias  # o_proj has no bias
    assert [glm.is_moe_layer(i) for i in (2, 3)] == [False, True]
    assert glm.kv_bytes_per_token(92, 0, 8, 2) == 92 * 2 * 1 * 128 * 2  # 8 KV heads over 8


def test_fp8_splits_must_keep_whole_blocks():
    qwen = CATALOG["Qwen3-235B-A22B-FP8"].shape
    quant = QuantizationConfig.for_checkpoint({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}})  # fmt: skip
    assert block_cuts(qwen, 4, (128, 128)) == []
    assert block_cuts(qwen, 8, (128, 128), expert_parallel=True) == []
    with pytest.raises(ConfigError) as err:  # 1536 expert features: 192 a rank
        check_block_split(qwen, 8, quant)
    assert "tensor_parallel_size=8 would cut the 128x128 FP8 blocks" in err.value.message
    assert "expert gate_up_proj rows [0, 192) of 1536 (blocks of 128)" in err.value.message
    assert "--enable-expert-parallel" in err.value.hint and "1, 2, 3, 4, 6" in err.value.hint


def test_the_planner_keeps_fp8_blocks_whole_as_the_engine_does():
    spec = CATALOG["Qwen3-235B-A22B-FP8"]
    plan = make_plan(
        spec,
        inventory_from_flags(1, 8, 80),
        PlanOptions(tensor_parallel_size=8, enable_expert_parallel=True),
    )
    assert plan.tensor_parallel_size == 8
    with pytest.raises(ConfigError) as err:
        make_plan(spec, inventory_from_flags(1, 8, 80), PlanOptions(tensor_parallel_size=8))
    assert "expert gate_up_proj rows" in err.value.message


def test_fp8_on_a_device_that_cannot_run_it_says_what_to_change():
    check_fp8_device("cpu", None, has_triton=False)  # weight-only on the CPU
    check_fp8_device("cuda", (9, 0), has_triton=True)
    with pytest.raises(UnsupportedQuantizationError) as err:
        check_fp8_device("cuda", (8, 0), has_triton=True)  # A100
    assert "compute capability 8.9 or newer" in err.value.message and "8.0" in err.value.message
    assert "--device cpu" in err.value.hint
    with pytest.raises(UnsupportedQuantizationError) as err:
        check_fp8_device("cuda", (9, 0), has_triton=False)
    assert "pip install triton" in err.value.hint


def test_a_checkpoint_quantization_llmctl_does_not_read_is_named():
    with pytest.raises(UnsupportedQuantizationError) as err:
        QuantizationConfig.for_checkpoint({"quantization_config": {"quant_method": "awq"}})
    assert "'awq'" in err.value.message and "block-FP8" in err.value.hint
    assert QuantizationConfig.for_checkpoint({"vocab_size": 8}) is None


def test_an_architecture_llmctl_does_not_run_names_those_it_does():
    from llmctl.engine.errors import UnsupportedArchitectureError
    from llmctl.engine.models.registry import check_architecture

    with pytest.raises(UnsupportedArchitectureError) as err:
        check_architecture("DeepseekV4ForCausalLM")
    assert "'DeepseekV4ForCausalLM' is not supported" in err.value.message
    for name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"):
        assert name in err.value.hint
