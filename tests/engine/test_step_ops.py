"""The device ops of one decode step, counted on the simulated device (tests/device_check.py) as a
CUDA run launches them: per decoder layer of a Llama in bfloat16 on the Triton backend, at most
12 (issue 31: each costs ~2 us even inside a CUDA graph). A layer is now: fused residual add +
RMSNorm, the QKV matmul, rotary (in place, on views of the QKV output), the KV-cache write,
paged decode attention, the output matmul, fused add + RMSNorm, the gate/up matmul, SiLU-and-mul
and the down matmul; no contiguous() copy, no float32 round trips. Counted as the difference
between a 4-layer and a 2-layer model's step, so the embedding, final norm, LM head and sampling
stay out."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from device_check import DEVICE, DeviceCheckMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.engine_config import DeviceConfig
from llmctl.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from llmctl.engine.distributed.partition import pipeline_shard
from llmctl.engine.model_loader.loader import load_model
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.worker.model_runner import ModelRunner

EXPECTED_PER_LAYER = {
    "llmctl::fused_add_rms_norm": 2,
    "aten::linear": 4,  # QKV, O, gate/up, down: one GEMM each
    "llmctl::rotary_embedding": 1,
    "llmctl::reshape_and_cache": 1,
    "llmctl::paged_decode_attention": 1,
    "llmctl::silu_and_mul": 1,
}


class CountOps(TorchDispatchMode):
    """Counts the ops that launch work: views (no kernel) are left out, and so is a `to` that
    changes nothing (it returns its input; one that converts is a copy, and counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        converted = func.name().startswith("aten::to") and out is not args[0]
        if not func.is_view or converted:
            self.ops[func.name()] += 1
        return out


def _runner(tmp_path, layers: int) -> ModelRunner:
    """A Llama-shaped model (GQA) with random weights on the simulated device."""
    config_json = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
    }  # fmt: skip
    path = tmp_path / f"llama-{layers}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_json))
    config = EngineArgs(
        model=str(path), device="cpu", dtype="bfloat16", load_format="dummy",
        num_gpu_blocks_override=64,
    ).create_engine_config()  # fmt: skip
    device_config = DeviceConfig()
    object.__setattr__(device_config, "device", DEVICE)  # not a user-facing device
    config = dataclasses.replace(config, device_config=device_config)
    mc = config.model_config
    runner = ModelRunner(config, load_model(mc, pipeline_shard(mc.num_layers, 0, 1, None), DEVICE))
    runner.initialize_kv_cache(64)
    return runner


def _decode_step_ops(runner: ModelRunner) -> Counter[str]:
    greedy = SamplingParams(temperature=0)
    prefill = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("a", [5, 6, 7], 3, greedy, [[1]], 0),
            NewRequestData("b", [8, 9], 2, greedy, [[2]], 0),
        ],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"a": 3, "b": 2},
        total_num_scheduled_tokens=5,
    )
    decode = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[
            CachedRequestData("a", [9], [[]], 3),
            CachedRequestData("b", [4], [[]], 2),
        ],
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
        finished_req_ids=set(),
    )
    with DeviceCheckMode():
        runner.execute_model(prefill)
    with DeviceCheckMode(), CountOps() as counter:
        runner.execute_model(decode)
    return counter.ops


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", "triton")


def test_a_decode_step_launches_at_most_12_ops_per_layer(tmp_path):
    two, four = _decode_step_ops(_runner(tmp_path, 2)), _decode_step_ops(_runner(tmp_path, 4))
    per_two_layers = four - two
    per_layer = {op: n / 2 for op, n in per_two_layers.items()}

    assert per_layer == EXPECTED_PER_LAYER
    assert sum(per_layer.values()) <= 12


def test_without_the_fused_kernels_a_layer_launches_three_times_as_many(tmp_path, monkeypatch):
    """LLMCTL_FUSED_LAYER_KERNELS=0, the plain torch layers: what the count above saves (the
    issue's read of them: RMSNorm 9 ops with its float32 round trip, rotary neg/cat/mul/mul/add
    for q and k, silu and mul apart)."""
    monkeypatch.setenv("LLMCTL_FUSED_LAYER_KERNELS", "0")
    two, four = _decode_step_ops(_runner(tmp_path, 2)), _decode_step_ops(_runner(tmp_path, 4))
    per_layer = {op: n / 2 for op, n in (four - two).items()}
    assert per_layer["aten::to.dtype"] == 4  # two norms, each to float32 and back
    assert sum(per_layer.values()) >= 36
