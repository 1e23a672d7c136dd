"""The engine's CPU kernels, in the order they build (the fused decode step calls the other two).

`python -m llmctl.engine.kernels.cpu.cpu_kernels` compiles (or finds) each now, as `make setup`
and the cpu image's build run it, so that the first engine start does not wait for the compiler. It
prints one line a kernel and exits 1 if any is unavailable; the engine then runs that part on a
slower path, and the kernel's own warning says why.
"""

from __future__ import annotations

import logging

from llmctl.engine.kernels.cpu import fp8_matmul, fused_decode, paged_attention_cpu
from llmctl.engine.kernels.cpu import quantized_matmul as quantized_matmul

KERNELS = {
    "paged attention": paged_attention_cpu,
    "quantized matmul": quantized_matmul,
    "fused decode": fused_decode,
    "FP8 matmul": fp8_matmul,
}


def availability() -> dict[str, bool]:
    """Each kernel's name: whether it is built and loaded (building it now if needed)."""
    return {name: module.kernel_available() for name, module in KERNELS.items()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = availability()
    for name, ok in ready.items():
        print(f"CPU {name} kernel: {'ready' if ok else 'unavailable'}")
    return 0 if all(ready.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
