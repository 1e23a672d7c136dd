"""DeviceLimit: the most a device can do, the yardstick of `llmctl bench`'s "fraction of limit".

Two numbers bound a step: memory bandwidth (a decode step reads every weight and its sequences'
KV cache once) and matmul FLOP/s (a prefill multiplies every weight by every token). Where they
come from, in order:

- a spec table of known NVIDIA GPUs (the datasheet's HBM bandwidth and dense bf16/fp16 tensor
  FLOP/s; fp32 without tensor cores for float32 models, which run with TF32 off);
- on another GPU, measured: a device-to-device copy of 1 GiB (bytes read plus written) and an
  8192^3 matmul in the model's dtype;
- on a CPU, measured: a STREAM-like copy and triad over arrays far larger than the caches, on the
  threads torch uses, and a 2048^3 matmul in the model's dtype.

`source` says which, so a reader knows whether a fraction is against a datasheet or a probe.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

# name fragment (lower case, most specific first) -> (bytes/s, bf16/fp16 dense FLOP/s, fp32 FLOP/s)
GPU_SPECS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("gh200", (4.0e12, 989e12, 67e12)),
    ("h100 nvl", (3.9e12, 835e12, 60e12)),
    ("h100 pcie", (2.0e12, 756e12, 51e12)),
    ("h100", (3.35e12, 989e12, 67e12)),  # SXM5: "NVIDIA H100 80GB HBM3"
    ("h200", (4.8e12, 989e12, 67e12)),
    ("h20", (4.0e12, 148e12, 44e12)),
    ("b200", (8.0e12, 2250e12, 80e12)),
    ("a100-sxm4-80gb", (2.039e12, 312e12, 19.5e12)),
    ("a100 80gb pcie", (1.935e12, 312e12, 19.5e12)),
    ("a100", (1.555e12, 312e12, 19.5e12)),  # the 40 GB parts
    ("l40s", (0.864e12, 362e12, 91.6e12)),
    ("l4", (0.3e12, 121e12, 30.3e12)),
    ("rtx 4090", (1.008e12, 165e12, 82.6e12)),
)


@dataclass(frozen=True)
class DeviceLimit:
    device: str  # e.g. "NVIDIA H100 80GB HBM3", or the CPU's model name
    bandwidth: float  # bytes/s of device memory
    peak_flops: float  # matmul FLOP/s in the dtype the model runs in
    source: str  # "spec table", "measured copy + matmul", "measured STREAM-like + matmul"
    dtype: str

    def as_dict(self) -> dict:
        return asdict(self)


def spec_limit(name: str, dtype: str) -> DeviceLimit | None:
    """The spec table's entry for a GPU named `name` (torch.cuda.get_device_name), or None."""
    key = name.lower()
    for fragment, (bandwidth, tensor_flops, fp32_flops) in GPU_SPECS:
        if fragment in key:
            flops = fp32_flops if dtype == "float32" else tensor_flops
            return DeviceLimit(name, bandwidth, flops, f"spec table ({fragment})", dtype)
    return None


@functools.cache
def device_limit(device: str, dtype: str) -> DeviceLimit:
    """The limit of `device` ("cuda" or "cpu") for a model in `dtype` (measured once per
    process where the spec table does not know the device)."""
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
        known = spec_limit(name, dtype)
        if known is not None:
            return known
        return DeviceLimit(
            name,
            measure_copy_bandwidth("cuda"),
            measure_matmul_flops("cuda", dtype, 8192),
            "measured copy + matmul",
            dtype,
        )
    return DeviceLimit(
        cpu_name(),
        measure_stream_bandwidth(),
        measure_matmul_flops("cpu", dtype, 2048),
        "measured STREAM-like + matmul",
        dtype,
    )


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (the best of
    `repeats`, after one warm-up)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 1):
        seconds = _timed(device, lambda: dst.copy_(src))
        if i:
            best = min(best, seconds)
    return 2 * nbytes / best


def measure_stream_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of main memory on the CPU, STREAM's way: the best of copy (a = b: 2 arrays'
    bytes) and triad (a = b + s * c: 3 arrays'), over float32 arrays of `nbytes` each, on the
    threads torch uses."""
    import torch

    n = nbytes // 4
    a, b, c = (torch.empty(n).uniform_() for _ in range(3))
    rates = []
    for i in range(repeats + 1):
        copy = _timed("cpu", lambda: a.copy_(b))
        triad = _timed("cpu", lambda: torch.add(b, c, alpha=3.0, out=a))
        if i:
            rates += [2 * nbytes / copy, 3 * nbytes / triad]
    return max(rates)


def measure_matmul_flops(device: str, dtype: str, n: int, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (the best of `repeats`, after a warm-up)."""
    import torch

    from llmctl.engine.platform import torch_dtype

    a = torch.empty(n, n, dtype=torch_dtype(dtype), device=device).uniform_(-1, 1)
    b = torch.empty_like(a).uniform_(-1, 1)
    best = float("inf")
    for i in range(repeats + 1):
        seconds = _timed(device, lambda: torch.mm(a, b))
        if i:
            best = min(best, seconds)
    return 2 * n**3 / best


def _timed(device: str, work) -> float:
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    begin = time.perf_counter()
    work()
    return time.perf_counter() - begin


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
