"""DeepSeek-V3 (with and without low-rank queries), DeepSeek-V2 and GLM-4.5 (tests/support.py
routed_configs), token-exact against Hugging Face transformers in float32: 8 prompts x 24 greedy
tokens, batched, alone, at tp=2, pp=2 and ep=2 on mp processes, with two data-parallel replicas
sharing the experts, and on the Triton attention path (the interpreter without a GPU). The MLA
cache holds (kv_lora_rank + qk_rope_head_dim) values a token and layer, and the engine's block
count is the KV budget over exactly that."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
from support import (
    ROUTED_FAMILIES,
    generate_in_new_thread,
    live_pids,
    random_prompts,
    token_ids,
)

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.config.memory_profile import cpu_num_gpu_blocks

GREEDY_24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [3, 9, 17, 30, 5, 12, 24, 7]
SPACE_GIB = 0.02
COMMON = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=SPACE_GIB)


def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=5)


@pytest.fixture(scope="module")
def expected(tiny_models, hf_greedy):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            _, hf_model = tiny_models.get(family)
            cache[family] = [hf_greedy(hf_model, p, 24) for p in prompts()]
        return cache[family]

    return get


def generate(path, caplog, **kwargs) -> tuple[list[list[int]], int, int]:
    """(tokens, the engine's KV blocks, the KV cache tokens it logs); every worker gone after."""
    before = live_pids(parent=os.getpid())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmctl"), LLM(str(path), **COMMON, **kwargs) as llm:
        tokens = token_ids(llm.generate(prompts(), GREEDY_24, use_tqdm=False))
        blocks = llm.llm_engine.num_blocks
    assert live_pids(parent=os.getpid()) <= before
    logged = re.findall(r"KV cache size: ([\d,]+) tokens", caplog.text)
    return tokens, blocks, int(logged[-1].replace(",", ""))


def mla_bytes_per_block(config, block_size: int = 16) -> int:
    """A block's bytes for every layer: (kv_lora_rank + qk_rope_head_dim) float32 values a
    token and layer."""
    per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * 4 * config.num_hidden_layers
    return block_size * per_token


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_one_rank_matches_transformers(family, tiny_models, expected, caplog):
    path, hf_model = tiny_models.get(family)
    tokens, blocks, logged = generate(path, caplog)
    assert tokens == expected(family)
    if family.startswith("deepseek"):  # the latent cache: its bytes are the block count's
        assert blocks == cpu_num_gpu_blocks(SPACE_GIB, mla_bytes_per_block(hf_model.config))
        assert logged == blocks * 16


def test_the_latent_cache_is_one_row_a_token(tiny_models):
    path, hf_model = tiny_models.get("deepseek-v3")
    config = hf_model.config
    llm = LLM(str(path), **COMMON)
    runner = llm.llm_engine.executor.worker.model_runner
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.kv_cache_bytes_per_block() == mla_bytes_per_block(config)
    assert [tuple(c.shape) for c in runner.kv_caches] == [
        (llm.llm_engine.num_blocks, 16, width)
    ] * 2
    assert runner.attn_backend.name == "torch-mla"
    llm.shutdown()


# One engine per layout, all 8 prompts in one batch.
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}
CASES = [
    (family, layout)
    for family in ("deepseek-v3", "deepseek-v3-no-q-lora", "glm4-moe")
    for layout in LAYOUTS
]


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_layouts_on_mp_match_transformers(family, layout, tiny_models, expected, caplog):
    path, hf_model = tiny_models.get(family)
    tokens, blocks, logged = generate(
        path, caplog, distributed_executor_backend="mp", **LAYOUTS[layout]
    )
    assert tokens == expected(family)
    if family.startswith("deepseek"):
        config = hf_model.config
        # tp: every rank holds the whole latent of its layers; pp: each stage its one layer
        layers = config.num_hidden_layers // (2 if layout == "pp2" else 1)
        per_block = mla_bytes_per_block(config) * layers // config.num_hidden_layers
        assert logged == cpu_num_gpu_blocks(SPACE_GIB, per_block) * 16


def test_two_replicas_sharing_the_experts_match_transformers(tiny_models, expected):
    """dp=2 with expert parallelism: data-parallel MLA attention, the experts over both."""
    path = tiny_models.path("deepseek-v3")
    with LLM(str(path), data_parallel_size=2, enable_expert_parallel=True, **COMMON) as llm:
        tokens = token_ids(llm.generate(prompts(), GREEDY_24, use_tqdm=False))
    assert tokens == expected("deepseek-v3")


@pytest.mark.parametrize("family, backend", [("deepseek-v3", "triton-mla"), ("glm4-moe", "triton")])
def test_triton_attention_path_matches_transformers(
    family, backend, tiny_models, expected, monkeypatch
):
    """The Triton kernels through the engine (DeepSeek's MLA ones: the latent cache write, the
    absorbed decode; GLM-4.5's paged attention after its partial rotary); in Triton's
    interpreter on a machine without a GPU."""
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", "triton")
    path = tiny_models.path(family)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(path), device=device, **COMMON)
    assert llm.llm_engine.executor.worker.model_runner.attn_backend.name == backend
    outputs = generate_in_new_thread(llm, prompts(), GREEDY_24)  # Triton's interpreter
    llm.shutdown()
    tokens = token_ids(outputs)
    assert tokens == expected(family)


def test_a_kimi_k2_checkpoint_reads_as_deepseek_v3(tiny_models, expected, tmp_path):
    """Kimi-K2's config.json names model_type kimi_k2 with custom code (auto_map) for what is
    transformers' DeepseekV3Config: read without running (or asking to trust) that code."""
    import json
    import shutil

    path = tmp_path / "kimi-k2"
    shutil.copytree(tiny_models.path("deepseek-v3"), path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    (path / "config.json").write_text(json.dumps(config))
    with LLM(str(path), **COMMON) as llm:
        tokens = token_ids(llm.generate(prompts()[:2], GREEDY_24, use_tqdm=False))
    assert tokens == expected("deepseek-v3")[:2]
