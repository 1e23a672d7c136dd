"""The worker's CUDA memory sizing, on this CPU-only machine: torch.cuda's counters are replaced by
a scripted GPU, so the order of the measurements, the arithmetic and the errors are checked here;
tests/cuda checks them against a real one."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from llmctl.engine.config.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from llmctl.engine.config.memory_profile import GIB
from llmctl.engine.core.llm_engine import LLMEngine
from llmctl.engine.errors import DeviceMemoryError
from llmctl.engine.worker.worker import Worker

BLOCK_BYTES = 2 << 20


def cuda_config(utilization: float = 0.9, dtype: str = "bfloat16") -> EngineConfig:
    hf_config = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
    )
    return EngineConfig(
        model_config=ModelConfig("m", "/m", hf_config, dtype=dtype, max_model_len=4096),
        cache_config=CacheConfig(gpu_memory_utilization=utilization),
        scheduler_config=SchedulerConfig(),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cuda"),
    )


class ScriptedGPU:
    """torch.cuda's memory counters for an 80 GiB GPU: 16 GiB of weights loaded, a profile step
    peaking 3 GiB above them, 1 GiB of it still cached, 0.5 GiB used outside torch."""

    def __init__(self, oom_in_profile: bool = False) -> None:
        self.allocated = 16 * GIB
        self.peak = 17 * GIB  # loading peaked higher; reset_peak_memory_stats must forget it
        self.reserved = 16 * GIB
        self.non_torch = GIB // 2
        self.oom_in_profile = oom_in_profile
        self.calls: list[str] = []

    def install(self, monkeypatch) -> None:
        for name in ("empty_cache", "reset_peak_memory_stats", "synchronize", "mem_get_info",
                     "memory_allocated", "max_memory_allocated", "memory_reserved"):  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak")
        self.peak = self.allocated

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        total = 80 * GIB
        return total - self.reserved - self.non_torch, total

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.reserved

    def profile_run(self) -> None:
        self.calls.append("profile_run")
        if self.oom_in_profile:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        self.peak = self.allocated + 3 * GIB
        self.reserved = self.allocated + GIB  # activations freed, their blocks still cached


def worker_on(gpu: ScriptedGPU, monkeypatch, utilization: float = 0.9) -> Worker:
    gpu.install(monkeypatch)
    worker = Worker(cuda_config(utilization))
    worker.model_runner = SimpleNamespace(
        profile_run=gpu.profile_run, kv_cache_bytes_per_block=lambda: BLOCK_BYTES
    )
    return worker


def test_blocks_from_utilization_peak_and_non_torch_memory(monkeypatch, caplog):
    gpu = ScriptedGPU()
    worker = worker_on(gpu, monkeypatch)
    with caplog.at_level(logging.INFO, logger="llmctl"):
        blocks = worker.determine_num_available_blocks()
    assert gpu.calls == ["empty_cache", "reset_peak", "profile_run"]
    # 0.9 x 80 = 72 GiB - peak 19 GiB (weights 16 + activations 3) - non-torch 0.5 GiB
    assert blocks == int(52.5 * GIB) // BLOCK_BYTES
    assert (
        "Memory profiling (rank 0): 0.9 x 80.00 GiB = 72.00 GiB usable: weights 16.00 GiB, "
        "peak activations 3.00 GiB, non-torch 0.50 GiB, KV cache 52.50 GiB"
    ) in caplog.text


def test_no_room_left_is_a_typed_error(monkeypatch):
    worker = worker_on(ScriptedGPU(), monkeypatch, utilization=0.2)  # 16 GiB usable < 19.5 used
    with pytest.raises(DeviceMemoryError) as err:
        worker.determine_num_available_blocks()
    assert "no GPU memory is left for the KV cache" in err.value.message
    assert "--gpu-memory-utilization (now 0.2)" in err.value.hint


def test_out_of_memory_in_the_profile_step_is_a_typed_error(monkeypatch):
    worker = worker_on(ScriptedGPU(oom_in_profile=True), monkeypatch)
    with pytest.raises(DeviceMemoryError) as err:
        worker.determine_num_available_blocks()
    assert err.value.message == (
        "GPU 0 ran out of memory in the profile step of 8192 tokens (256 requests at most), "
        "with 16.00 of 80.00 GiB taken by the weights"
    )
    assert "--max-num-batched-tokens" in err.value.hint and "-tp/-pp" in err.value.hint
    assert err.value.__context__ is None  # no traceback keeps the step's tensors alive


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_that_do_not_fit_are_a_typed_error(monkeypatch, dtype):
    import llmctl.engine.model_loader.loader as loader

    gpu = ScriptedGPU()
    gpu.install(monkeypatch)

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(loader, "load_model", out_of_memory)
    worker = Worker(cuda_config(dtype=dtype))
    with pytest.raises(DeviceMemoryError) as err:
        worker.load_model()
    message, hint = err.value.message, err.value.hint
    assert message.startswith(
        f"the weights of rank 0 (layers 0-3, tensor-parallel rank 0 of 1, {dtype}) do not fit on "
        "GPU 0: it ran out of memory loading them (63.50 of 80.00 GiB were free)"
    )
    assert "-tp N" in hint and "-pp N" in hint and "--distributed-executor-backend ray" in hint
    assert "--max-model-len does not shrink weights" in hint
    assert "quantized weights would, but llmctl loads weights unquantized" in hint
    assert ("--dtype bfloat16 halves float32 weights" in hint) == (dtype == "float32")
    assert err.value.__context__ is None
    assert worker.model_runner is None


@pytest.mark.parametrize(
    ("device", "line"), [("cuda", "GPU KV cache size"), ("cpu", "KV cache size")]
)
def test_kv_cache_lines_use_vllms_words_on_cuda(device, line, caplog):
    config = cuda_config()
    config = EngineConfig(**{**vars(config), "device_config": DeviceConfig(device)})
    with caplog.at_level(logging.INFO, logger="llmctl"):
        LLMEngine._log_kv_cache(SimpleNamespace(config=config, num_blocks=1000))
    assert caplog.messages == [
        "# KV cache blocks: 1000 (block size 16)",
        f"{line}: 16,000 tokens",
        "Maximum concurrency for 4,096 tokens per request: 3.91x",
    ]
