"""DeviceLimit: the datasheet figures of known GPUs by the names torch reports, and the probes
that measure a device the table does not know (on this CPU: STREAM-like bandwidth, a matmul)."""

from __future__ import annotations

import pytest

from llmctl.engine.benchmarks.device_limit import (
    measure_matmul_flops,
    measure_stream_bandwidth,
    spec_limit,
)


@pytest.mark.parametrize(
    ("name", "bandwidth", "bf16_flops"),
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12, 989e12),
        ("NVIDIA H100 PCIe", 2.0e12, 756e12),
        ("NVIDIA H100 NVL", 3.9e12, 835e12),
        ("NVIDIA H200", 4.8e12, 989e12),
        ("NVIDIA GH200 480GB", 4.0e12, 989e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12, 312e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12, 312e12),
        ("NVIDIA L4", 0.3e12, 121e12),
    ],
)
def test_known_gpus_come_from_the_spec_table(name, bandwidth, bf16_flops):
    limit = spec_limit(name, "bfloat16")
    assert (limit.bandwidth, limit.peak_flops) == (bandwidth, bf16_flops)
    assert limit.source.startswith("spec table")


def test_float32_models_are_held_to_the_fp32_rate():
    assert spec_limit("NVIDIA H100 80GB HBM3", "float32").peak_flops == 67e12


def test_an_unknown_gpu_is_not_in_the_table():
    assert spec_limit("NVIDIA GeForce GTX 1080", "bfloat16") is None


def test_the_cpu_probes_measure_something_plausible():
    bandwidth = measure_stream_bandwidth(8 << 20, repeats=2)
    flops = measure_matmul_flops("cpu", "float32", 256, repeats=2)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s
    assert 1e7 < flops < 1e14
