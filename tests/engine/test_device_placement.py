"""Every model family's step, run on a simulated device (tests/device_check.py): prefill
after a prefix-cache hit, a chunked prefill, decodes, sampling with penalties, seeds, logprobs,
min_tokens and logit_bias, and the memory-profiling forward. Any host tensor in the device path
fails the test, and sampled ids come back in one copy per step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from device_check import DEVICE, DeviceCheckMode, HostTensorOnDeviceError
from support import FAMILIES, NEW_FAMILIES
from test_quantized import write_tiny_gguf

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.engine_config import DeviceConfig
from llmctl.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from llmctl.engine.distributed.partition import pipeline_shard
from llmctl.engine.model_loader.loader import load_model
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.worker.model_runner import ModelRunner

BLOCK = 16


def _runner(path, **engine_args) -> ModelRunner:
    config = EngineArgs(
        model=str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64, **engine_args
    ).create_engine_config()
    device_config = DeviceConfig()
    object.__setattr__(device_config, "device", DEVICE)  # not a user-facing device
    config = dataclasses.replace(config, device_config=device_config)
    mc = config.model_config
    model = load_model(mc, pipeline_shard(mc.num_layers, 0, 1, None), DEVICE)
    runner = ModelRunner(config, model)
    runner.initialize_kv_cache(64)
    return runner


def _steps(vocab: int, groups: int = 1) -> list[SchedulerOutput]:
    """A prefix hit (16 of 20 prompt tokens cached), a prompt of 40 in chunks of 24 and 16, and
    a third request sampled with every option; then decodes. Block ids alike in each of the
    model's `groups` KV cache groups."""

    def b(*ids: int) -> list[list[int]]:
        return [list(ids) for _ in range(groups)]

    fancy = SamplingParams(
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logprobs=3,
        min_tokens=2,
        logit_bias={3: 2.0, 5: -1.0},
    )
    plain = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=1.0, seed=3)
    tokens = [(i * 37) % (vocab - 10) + 5 for i in range(40)]
    first = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("hit", tokens[:20], 20, plain, b(5, 3), 16),
            NewRequestData("chunked", tokens, 40, seeded, b(7, 1, 9), 0),
            NewRequestData("fancy", tokens[:9], 9, fancy, b(11), 0),
        ],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"hit": 4, "chunked": 24, "fancy": 9},
        total_num_scheduled_tokens=37,
    )
    second = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[
            CachedRequestData("hit", [42], b(), 20),
            CachedRequestData("chunked", [], b(), 24),
            CachedRequestData("fancy", [43], b(), 9),
        ],
        num_scheduled_tokens={"hit": 1, "chunked": 16, "fancy": 1},
        total_num_scheduled_tokens=18,
    )
    third = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[
            CachedRequestData("hit", [44], b(2), 21),
            CachedRequestData("chunked", [45], b(4), 40),
            CachedRequestData("fancy", [46], b(), 10),
        ],
        num_scheduled_tokens={"hit": 1, "chunked": 1, "fancy": 1},
        total_num_scheduled_tokens=3,
        finished_req_ids=set(),
    )
    return [first, second, third]


@pytest.mark.parametrize("backend", ["triton", "torch"])
# The dense families (a mixture of experts' dispatch, gpt-oss's too, counts tokens per expert
# with bincount, which the meta device cannot run).
@pytest.mark.parametrize("family", FAMILIES + [f for f in NEW_FAMILIES if f != "gpt-oss"])
def test_step_on_device_has_no_host_tensor(tiny_models, family, backend, monkeypatch):
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", backend)
    runner = _runner(tiny_models.path(family))
    everyone = {"hit", "chunked", "fancy"}
    expected = [{"hit", "fancy"}, everyone, everyone]
    with DeviceCheckMode() as mode:
        steps = _steps(runner.vocab_size, runner.num_groups)
        for step, sampled in zip(steps, expected, strict=True):
            before = mode.device_to_host
            output = runner.execute_model(step)
            assert set(output.sampled_token_ids) == sampled
            assert mode.device_to_host - before == 1, "sampled ids: one copy per step"
        assert set(output.logprobs) == {"fancy"}
        assert len(output.logprobs["fancy"].top_token_ids) == 3
        assert mode.host_to_device > 0


def test_quantized_gguf_step_on_device(tmp_path, monkeypatch):
    """A GGUF model's blocks stay packed on the device: its linear layers run the Triton
    group-quantized matmul (the custom op llmctl::group_quantized_mm), its embedding expands
    only the looked-up rows, and no host tensor meets a device one."""
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    runner = _runner(tmp_path / "tiny.gguf", skip_tokenizer_init=True)
    assert runner.config.model_config.quantization.method == "gguf"
    with DeviceCheckMode() as mode:
        for step in _steps(runner.vocab_size):
            before = mode.device_to_host
            runner.execute_model(step)
            assert mode.device_to_host - before == 1, "sampled ids: one copy per step"
    # per step, 2 layers x 5 packed matmuls (qkv in two parts: attn_v is Q8_0, q and k Q4_1;
    # o, gate_up, down) and the LM head, tied to the Q8_0 token embedding
    assert mode.calls["llmctl::group_quantized_mm"] == 3 * (2 * 5 + 1)


def test_profile_run_on_device(tiny_models):
    runner = _runner(tiny_models.path("mistral"), max_num_batched_tokens=300, max_num_seqs=7)
    with DeviceCheckMode():
        runner.profile_run()
    assert all(cache.shape[1] == 0 for cache in runner.kv_caches)  # the one-block cache is gone


def test_the_check_catches_a_host_index():
    """The mistake the check exists for: a host index meeting a device tensor."""
    cache = torch.zeros(8, 4, device=DEVICE)
    with DeviceCheckMode(), pytest.raises(HostTensorOnDeviceError, match="index_copy"):
        cache.index_copy_(0, torch.tensor([1, 2]), torch.ones(2, 4, device=DEVICE))
    with DeviceCheckMode(), pytest.raises(HostTensorOnDeviceError, match="index_select"):
        cache.index_select(0, torch.tensor([1, 2]))


def test_dummy_batch_on_device(tiny_models):
    """A data-parallel replica's dummy forward (engine/dp/lockstep.py) on the device: no host
    tensor, and the layers' KV caches bound again after it (its key and value go to a scratch
    block; tests/engine/test_dp_expert_parallel.py checks no cached block changes)."""
    # (a dense family: the check's fake device has no bincount, which MoE routing uses)
    runner = _runner(tiny_models.path("mistral"))
    with DeviceCheckMode():
        runner.execute_dummy_batch()
    layers = runner.attention_layers()
    assert all(
        layer.kv_cache is cache for layer, cache in zip(layers, runner.kv_caches, strict=True)
    )
    assert all(scratch.shape[1] == 1 for scratch in runner._scratch_kv)
