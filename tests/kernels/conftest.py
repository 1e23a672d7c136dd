"""Kernel tests: Triton kernels against plain torch references. Without a CUDA device they run
under Triton's CPU interpreter (TRITON_INTERPRET is set in tests/conftest.py, before anything
imports triton)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The GPU when there is one (the kernels run natively), else the CPU (the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
