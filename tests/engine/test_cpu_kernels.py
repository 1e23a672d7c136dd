"""`python -m llmctl.engine.kernels.cpu.cpu_kernels`: what `make setup` and the cpu image's build
run."""

from __future__ import annotations

import subprocess
import sys

from llmctl.engine.kernels.cpu import cpu_kernels


def test_builds_every_kernel_and_says_so():
    done = subprocess.run(
        [sys.executable, "-m", "llmctl.engine.kernels.cpu.cpu_kernels"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [f"CPU {name} kernel: ready" for name in cpu_kernels.KERNELS]
    assert done.stdout.splitlines() == lines
    assert list(cpu_kernels.KERNELS) == [
        "paged attention",
        "quantized matmul",
        "fused decode",
        "FP8 matmul",
    ]


def test_a_kernel_that_does_not_build_fails_the_command(monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels.quantized_matmul, "kernel_available", lambda: False)
    assert cpu_kernels.main() == 1
    assert "CPU quantized matmul kernel: unavailable" in capsys.readouterr().out
