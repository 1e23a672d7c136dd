"""Token-exact against Hugging Face transformers: every family, every checkpoint format, and
whatever the scheduler does (preemption, prefix caching, chunked prefill, batch composition)."""

from __future__ import annotations

import logging
import re

import pytest
from support import FAMILIES, random_prompts, token_ids

from llmctl.engine import LLM, SamplingParams

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPT_LENGTHS = [3, 7, 12, 20, 31, 5, 16, 40]


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_8_matches_transformers(family, tiny_models, hf_greedy):
    path, hf_model = tiny_models.get(family)
    prompts = random_prompts(PROMPT_LENGTHS)
    llm = LLM(str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)
    outputs = llm.generate(prompts, GREEDY_32, use_tqdm=False)
    expected = [hf_greedy(hf_model, p, 32) for p in prompts]
    assert token_ids(outputs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("save", ["sharded", "bin"])
def test_checkpoint_formats_load_identically(save, tiny_models, hf_greedy):
    path, hf_model = tiny_models.get("llama", save=save)
    if save == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("model-*.safetensors"))) > 1
    else:
        assert (path / "pytorch_model.bin").is_file()
    prompts = random_prompts([9, 17])
    llm = LLM(str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)
    assert token_ids(llm.generate(prompts, GREEDY_32, use_tqdm=False)) == [
        hf_greedy(hf_model, p, 32) for p in prompts
    ]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_keeps_outputs(enable_prefix_caching, tiny_models, hf_greedy):
    path, hf_model = tiny_models.get("llama")
    prompts = random_prompts([30, 28, 26, 24, 22, 20, 18, 16])
    # 6 blocks of 16 = 96 slots: one request of max_model_len=80 fits, eight cannot run at once.
    llm = LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        max_model_len=80,
        num_gpu_blocks_override=6,
        enable_prefix_caching=enable_prefix_caching,
    )
    outputs = llm.generate(prompts, GREEDY_32, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert token_ids(outputs) == [hf_greedy(hf_model, p, 32) for p in prompts]
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prefix_caching_on_and_off(enable_prefix_caching, tiny_models, hf_greedy):
    path, hf_model = tiny_models.get("qwen2")
    shared = random_prompts([48], seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 17, 1], seed=2)]
    llm = LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.05,
        enable_prefix_caching=enable_prefix_caching,
    )
    first = llm.generate(prompts[:1], GREEDY_32, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY_32, use_tqdm=False)
    assert token_ids(first + rest) == [hf_greedy(hf_model, p, 32) for p in prompts]
    stats = llm.llm_engine.get_stats()
    if enable_prefix_caching:
        # The three later prompts each find the 3 full blocks of the shared 48 tokens.
        assert stats.prefix_cache_hits == 3 * 48
        assert 0 < stats.prefix_cache_hit_rate < 1
        assert rest[0].num_cached_tokens == 48
    else:
        assert stats.prefix_cache_hits == 0
        assert rest[0].num_cached_tokens == 0


def test_alone_or_in_a_batch_of_32(tiny_models):
    path, _ = tiny_models.get("gpt2")
    prompts = random_prompts([5 + (i * 7) % 40 for i in range(32)], seed=3)
    llm = LLM(str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)
    batch = token_ids(llm.generate(prompts, GREEDY_32, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY_32, use_tqdm=False))[0] for p in prompts[:6]]
    assert alone == batch[:6]


def test_chunked_prefill_of_long_prompts(tiny_models, hf_greedy):
    path, hf_model = tiny_models.get("mistral")
    prompts = random_prompts([100, 70, 45])
    # A 16-token budget per step: every prompt is prefilled in chunks over several steps.
    llm = LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.05,
        max_num_batched_tokens=16,
    )
    outputs = llm.generate(prompts, GREEDY_32, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy(hf_model, p, 32) for p in prompts]


def test_kv_cache_lines_are_logged(tiny_models, caplog):
    path = tiny_models.path("llama")
    with caplog.at_level(logging.INFO, logger="llmctl"):
        llm = LLM(
            str(path),
            use_tqdm_on_load=False,
            dtype="float32",
            kv_cache_space_gib=0.01,
            max_model_len=200,
        )
    text = caplog.text
    blocks = int(re.search(r"# KV cache blocks: (\d+) \(block size 16\)", text).group(1))
    # 4 layers x 2 (K, V) x 16 slots x 2 KV heads x 16 dims x 4 bytes per block
    assert blocks == int(0.01 * 2**30) // (4 * 2 * 16 * 2 * 16 * 4)
    tokens = blocks * 16
    assert f"KV cache size: {tokens:,} tokens" in text
    assert f"Maximum concurrency for 200 tokens per request: {tokens / 200:.2f}x" in text
    assert llm.llm_engine.num_blocks == blocks


def test_text_and_token_ids_agree(tiny_models, smol_tokenizer):
    path = tiny_models.path("opt")
    llm = LLM(str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)
    out = llm.generate("Hello world, this is a test", GREEDY_32, use_tqdm=False)[0]
    assert out.prompt == "Hello world, this is a test"
    assert out.prompt_token_ids == smol_tokenizer.encode("Hello world, this is a test")
    completion = out.outputs[0]
    assert completion.text == smol_tokenizer.decode(completion.token_ids, skip_special_tokens=True)
