"""The CUDA KV-cache arithmetic the engine and the planner share (pure: no torch, no GPU)."""

from __future__ import annotations

import pytest

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine.config.memory_profile import (
    CUDA_CONTEXT_BYTES,
    GIB,
    NCCL_BYTES,
    SAMPLER_BYTES_PER_LOGIT,
    MemoryProfile,
    check_gpu_memory_utilization,
    estimate_activation_bytes,
    num_gpu_blocks,
    profile_request_lengths,
)
from llmctl.engine.errors import ConfigError, DeviceMemoryError

H100 = MemoryProfile(
    total_bytes=80 * GIB, weight_bytes=16 * GIB, peak_torch_bytes=18 * GIB, non_torch_bytes=GIB
)


def test_kv_cache_is_what_utilization_leaves_after_peak_and_non_torch_memory():
    # 0.9 x 80 = 72 GiB usable; 18 GiB peak (16 weights + 2 activations); 1 GiB outside torch.
    assert H100.usable_bytes(0.9) == 72 * GIB
    assert H100.activation_bytes == 2 * GIB
    assert H100.kv_cache_bytes(0.9) == 53 * GIB
    block = 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 slots, 8 KV heads, 128 dims, bf16
    assert num_gpu_blocks(H100, 0.9, block) == 53 * 512 == 27136  # 2 MiB blocks
    assert H100.describe(0.9) == (
        "0.9 x 80.00 GiB = 72.00 GiB usable: weights 16.00 GiB, peak activations 2.00 GiB, "
        "non-torch 1.00 GiB, KV cache 53.00 GiB"
    )


@pytest.mark.parametrize("utilization", [0.2, 0.2375])  # 16 GiB and 19 GiB usable: 19 GiB used
def test_nothing_left_for_the_kv_cache_names_the_knobs(utilization):
    with pytest.raises(DeviceMemoryError) as err:
        num_gpu_blocks(H100, utilization, 4096)
    assert isinstance(err.value, ConfigError)
    assert err.value.message.startswith("no GPU memory is left for the KV cache: ")
    assert "weights 16.00 GiB, peak activations 2.00 GiB, non-torch 1.00 GiB" in err.value.message
    for knob in ("--gpu-memory-utilization", "--max-num-batched-tokens", "-tp/-pp"):
        assert knob in err.value.hint
    assert f"now {utilization:g}" in err.value.hint


@pytest.mark.parametrize("value", [0, -0.5, 1.01, 90, float("nan"), True])
def test_utilization_outside_0_1_is_refused_naming_the_flag(value):
    with pytest.raises(ConfigError) as err:
        check_gpu_memory_utilization(value)
    assert "gpu_memory_utilization must be in (0, 1]" in err.value.message
    assert "--gpu-memory-utilization" in err.value.hint


@pytest.mark.parametrize("value", [1, 1.0, 0.9, 0.01])
def test_utilization_inside_0_1_is_accepted(value):
    check_gpu_memory_utilization(value)


@pytest.mark.parametrize(
    ("tokens", "max_num_seqs", "max_model_len", "expected"),
    [
        (8192, 256, 4096, [32] * 256),  # the defaults: one sampled row per request
        (100, 256, 4096, [1] * 100),  # fewer tokens than requests
        (10, 4, 4096, [3, 3, 2, 2]),
        (8192, 1, 2048, [2048]),  # no dummy request longer than max_model_len
        (8192, 2, 100, [100, 100]),
    ],
)
def test_profile_batch(tokens, max_num_seqs, max_model_len, expected):
    assert profile_request_lengths(tokens, max_num_seqs, max_model_len) == expected


SMOL = dict(  # SmolLM2-135M on one rank in bfloat16, the profile step of the defaults
    num_tokens=8192,
    num_sampled=256,
    hidden_size=576,
    qkv_size=(9 + 2 * 3) * 64,
    intermediate_size=1536,
    vocab_shard=49152,
    vocab_size=49152,
    dtype_bytes=2,
    gated_mlp=True,
)


def test_activation_estimate_worked_example():
    # Forward, per token: attention 4 x 576 + 2 x 960 = 4224, MLP 3 x 576 + 4 x 1536 = 7872
    # elements; the MLP is the peak: 8192 tokens x 7872 x 2 bytes.
    forward = 8192 * 7872 * 2
    assert estimate_activation_bytes(**SMOL, is_last_stage=False, samples=False) == forward
    # Last stage, sampling rank: final hidden states and the 256 selected rows, their bf16
    # logits, then float32 logits and the sampler's temporaries.
    sampling = (8192 + 256) * 576 * 2 + 256 * 49152 * 2 + 256 * 49152 * SAMPLER_BYTES_PER_LOGIT
    assert sampling > forward
    assert estimate_activation_bytes(**SMOL, is_last_stage=True, samples=True) == sampling


def test_activation_estimate_of_a_tensor_parallel_shard():
    half = {**SMOL, "vocab_shard": 49152 // 2, "intermediate_size": 768, "qkv_size": 9 * 64}
    sampler_rank = estimate_activation_bytes(**half, is_last_stage=True, samples=True)
    other_rank = estimate_activation_bytes(**half, is_last_stage=True, samples=False)
    # The sampling rank also gathers the full bf16 row before the sampler runs.
    gathered = 256 * 49152 * 2 + 256 * 49152 * SAMPLER_BYTES_PER_LOGIT
    assert sampler_rank == (8192 + 256) * 576 * 2 + 256 * 24576 * 2 + gathered
    assert other_rank == max((8192 + 256) * 576 * 2 + 256 * 24576 * 2, 8192 * (1728 + 3072) * 2)
    not_gated = estimate_activation_bytes(
        **{**half, "gated_mlp": False}, is_last_stage=False, samples=False
    )
    assert not_gated == 8192 * max(4 * 576 + 2 * 576, 3 * 576 + 2 * 768) * 2


@pytest.mark.parametrize(
    ("tp", "non_torch"), [(1, CUDA_CONTEXT_BYTES), (2, CUDA_CONTEXT_BYTES + NCCL_BYTES)]
)
def test_planner_sizes_the_kv_cache_with_the_engines_arithmetic(tp, non_torch):
    spec = CATALOG["SmolLM2-135M-Instruct"]
    options = PlanOptions(dtype="bfloat16", tensor_parallel_size=tp, max_model_len=8192)
    plan = make_plan(spec, inventory_from_flags(1, 2, 24), options)
    for rank in plan.ranks:
        assert rank.non_torch_bytes == non_torch
        profile = MemoryProfile(
            total_bytes=24 * GIB,
            weight_bytes=rank.weight_bytes,
            peak_torch_bytes=rank.weight_bytes + rank.activation_bytes,
            non_torch_bytes=rank.non_torch_bytes,
        )
        assert rank.num_blocks == num_gpu_blocks(profile, 0.9, rank.kv_block_bytes)
    assert plan.num_kv_blocks == min(r.num_blocks for r in plan.ranks)
    assert (plan.profile_num_tokens, plan.profile_num_sampled) == (8192, 256)
    lines = plan.memory_lines()
    assert lines[0].startswith("the engine gives the KV cache what is left of 0.9 x 24.00 GiB")
    assert ("NCCL" in lines[3]) == (tp > 1)


def test_planner_profile_follows_max_num_batched_tokens():
    spec = CATALOG["Llama-3.1-8B"]
    small, large = (
        make_plan(
            spec,
            inventory_from_flags(1, 1, 80),
            PlanOptions(max_model_len=8192, max_num_batched_tokens=tokens),
        )
        for tokens in (2048, 32768)
    )
    assert small.ranks[0].activation_bytes < large.ranks[0].activation_bytes
    assert small.num_kv_blocks > large.num_kv_blocks
    assert large.profile_num_tokens == 32768
