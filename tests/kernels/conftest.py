"""Kernel tests: Triton kernels against plain torch references. Without a CUDA device they run
under Triton's CPU interpreter, which @triton.jit picks when it decorates a kernel, so
TRITON_INTERPRET is set here, before any test module imports the kernels."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The GPU when there is one (the kernels run natively), else the CPU (the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
