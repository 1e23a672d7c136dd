"""MLA and block FP8 on a simulated device (tests/device_check.py): a DeepSeek-V3 whose layers
are all dense (the check's fake device has no bincount, which MoE routing uses) runs its steps
through the torch and the Triton MLA backends, and an FP8 Llama through the Triton block-FP8
GEMM (the custom op llmctl::fp8_block_mm), with no host tensor meeting a device one and the
sampled ids back in one copy per step."""

from __future__ import annotations

import pytest
import torch
from device_check import DeviceCheckMode
from fp8_checkpoints import fp8_configs, write_fp8
from support import routed_configs
from test_device_placement import _runner, _steps


@pytest.fixture(scope="module")
def dense_deepseek(tmp_path_factory, smol_tokenizer):
    from transformers import AutoModelForCausalLM

    config = routed_configs()["deepseek-v3"]
    config.first_k_dense_replace = config.num_hidden_layers  # every layer dense
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("dense-deepseek") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("backend, name", [("triton", "triton-mla"), ("torch", "torch-mla")])
def test_mla_step_on_device_has_no_host_tensor(dense_deepseek, backend, name, monkeypatch):
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", backend)
    runner = _runner(dense_deepseek)
    assert runner.attn_backend.name == name
    with DeviceCheckMode() as mode:
        for step in _steps(runner.vocab_size):
            before = mode.device_to_host
            runner.execute_model(step)
            assert mode.device_to_host - before == 1, "sampled ids: one copy per step"
    if backend == "triton":  # 2 layers x 3 steps, each with decodes
        assert mode.calls["llmctl::mla_write_cache"] == 2 * 3
        assert mode.calls["llmctl::mla_decode_attention"] == 2 * 2  # steps 2 and 3 decode


def test_fp8_step_on_device_runs_the_block_fp8_gemm(tmp_path, smol_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", "triton")
    torch.manual_seed(0)
    paths = [tmp_path / kind for kind in ("float", "fp8", "dequantized")]
    AutoModelForCausalLM.from_config(fp8_configs()["llama"]).save_pretrained(paths[0])
    smol_tokenizer.save_pretrained(paths[0])
    write_fp8(*paths)
    runner = _runner(paths[1])
    assert runner.config.model_config.quantization.method == "fp8"
    with DeviceCheckMode() as mode:
        for step in _steps(runner.vocab_size):
            before = mode.device_to_host
            runner.execute_model(step)
            assert mode.device_to_host - before == 1, "sampled ids: one copy per step"
    # per step, 2 layers x 4 FP8 matmuls (qkv, o, gate_up, down); the LM head stays float
    assert mode.calls["llmctl::fp8_block_mm"] == 3 * 2 * 4
