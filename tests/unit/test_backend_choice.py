"""The executor backend rule of vLLM's docs: mp when this node has a device per rank and we are
not inside a Ray placement group; otherwise ray. On the CPU, devices are the declared
LLMCTL_CPU_DEVICES (default: usable cores)."""

from __future__ import annotations

import pytest

from llmctl.engine.config.engine_config import ParallelConfig
from llmctl.engine.errors import ConfigError
from llmctl.engine.executor.base import choose_backend, local_device_count


def pc(tp=1, pp=1, backend=None) -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend=backend
    )


def test_one_rank_runs_in_process():
    assert choose_backend(pc(), "cpu") == "uni"


@pytest.mark.parametrize("devices, expected", [("4", "mp"), ("8", "mp"), ("3", "ray")])
def test_enough_local_devices_means_mp(monkeypatch, devices, expected):
    monkeypatch.setenv("LLMCTL_CPU_DEVICES", devices)
    assert local_device_count("cpu") == int(devices)
    assert choose_backend(pc(tp=2, pp=2), "cpu") == expected


def test_default_cpu_devices_are_the_usable_cores(monkeypatch):
    import os

    monkeypatch.delenv("LLMCTL_CPU_DEVICES", raising=False)
    assert local_device_count("cpu") == len(os.sched_getaffinity(0))


def test_explicit_backend_wins(monkeypatch):
    monkeypatch.setenv("LLMCTL_CPU_DEVICES", "1")
    assert choose_backend(pc(tp=2, backend="mp"), "cpu") == "mp"
    monkeypatch.setenv("LLMCTL_CPU_DEVICES", "64")
    assert choose_backend(pc(tp=2, backend="ray"), "cpu") == "ray"


def test_bad_declared_device_count(monkeypatch):
    monkeypatch.setenv("LLMCTL_CPU_DEVICES", "two")
    with pytest.raises(ConfigError) as err:
        choose_backend(pc(tp=2), "cpu")
    assert "LLMCTL_CPU_DEVICES" in err.value.message


def test_uni_refuses_several_ranks():
    with pytest.raises(ConfigError) as err:
        pc(tp=2, backend="uni")
    assert "--distributed-executor-backend mp or ray" in err.value.hint


def test_cuda_layout_larger_than_the_node(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_backend(pc(tp=2), "cuda") == "mp"
    assert choose_backend(pc(tp=2, pp=2), "cuda") == "ray"  # vLLM's rule: Ray for more ranks
    assert choose_backend(pc(tp=2, pp=2, backend="ray"), "cuda") == "ray"
    with pytest.raises(ConfigError) as err:
        choose_backend(pc(tp=2, pp=2, backend="mp"), "cuda")  # one node: refused up front
    assert "needs 4 GPUs, but this node has 2" in err.value.message
    assert "-tp/-pp" in err.value.hint and "--distributed-executor-backend ray" in err.value.hint
