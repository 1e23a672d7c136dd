"""The cuda tier: the engine on a real NVIDIA GPU (every test module here is marked `cuda`, so it
is skipped with the reason on machines without one). Run it with `pytest -m cuda`.

float32 comparisons run with TF32 off on both sides (the engine and the transformers oracle share
this process), so a matmul on the GPU rounds as float32 does."""

from __future__ import annotations

import copy

import pytest
from support import free_gpu_memory


@pytest.fixture(autouse=True)
def _no_tf32():
    import torch

    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture
def gpu_llm():
    """gpu_llm(model, **kwargs) -> LLM on the GPU; every engine made is shut down and its memory
    (weights, KV cache, CUDA graphs) freed after the test, so the next one sizes its own."""
    from llmctl.engine import LLM

    made = []

    def make(model: str | None, **kwargs) -> LLM:
        llm = LLM(model, use_tqdm_on_load=False, device="cuda", **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()
    made.clear()
    free_gpu_memory()


@pytest.fixture
def hf_on_gpu():
    """hf_on_gpu(model, dtype) -> a copy of a Hugging Face model on the GPU in `dtype` (the
    session's CPU oracle stays as it is)."""
    copies = []

    def move(model, dtype):
        moved = copy.deepcopy(model).to(device="cuda", dtype=dtype).eval()
        copies.append(moved)
        return moved

    yield move
    copies.clear()
    free_gpu_memory()
