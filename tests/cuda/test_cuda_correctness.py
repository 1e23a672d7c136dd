"""The engine on the GPU against Hugging Face transformers on the same GPU: token-exact in float32
for every model family, with CUDA graphs and eagerly (--enforce-eager), and bfloat16 greedy equal
to transformers' bfloat16 for the first 16 tokens on the real SmolLM2; the bundled Q4_1 GGUF run
natively (the Triton group-quantized matmul) against its dequantized weights."""

from __future__ import annotations

import pytest
import torch
from support import (
    FAMILIES,
    MOE_FAMILIES,
    NEW_FAMILIES,
    assert_same_greedy,
    random_prompts,
    token_ids,
)

from llmctl.engine import SamplingParams

pytestmark = pytest.mark.cuda

PROMPT_LENGTHS = [3, 7, 12, 20, 31, 5, 16, 40]
# Budgets from 4 to 32 tokens: requests finish one after another, so decode batches shrink from
# 8 to 1 and run through graphs of padded sizes (8, 4, 2, 1).
MAX_TOKENS = [32, 4, 28, 8, 24, 12, 20, 16]
BLOCKS = 512  # 8,192 token slots; sizing the cache from GPU memory: test_cuda_plan.py
BF16_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The chemical symbol for gold is",
    "Once upon a time, there was a",
]


def runner_of(llm):
    """The ModelRunner of a one-rank engine (the uni executor runs it in this process)."""
    return llm.llm_engine.executor.worker.model_runner


# Issue 34's dense families too: Gemma 3's three KV cache groups and Phi-3's LongRoPE flags as
# CUDA graphs' static inputs.
DENSE = FAMILIES + [f for f in NEW_FAMILIES if f != "gpt-oss"]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("family", DENSE)
def test_float32_matches_transformers_on_the_gpu(
    family, enforce_eager, tiny_models, hf_greedy, gpu_llm, hf_on_gpu
):
    path, hf_model = tiny_models.get(family)
    hf = hf_on_gpu(hf_model, torch.float32)
    prompts = random_prompts(PROMPT_LENGTHS)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    llm = gpu_llm(
        str(path), dtype="float32", enforce_eager=enforce_eager, num_gpu_blocks_override=BLOCKS
    )
    # Graphs are captured unless --enforce-eager: both runs below really differ in how they decode.
    assert (runner_of(llm).cuda_graphs is None) == enforce_eager

    outputs = llm.generate(prompts, params, use_tqdm=False)

    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    assert token_ids(outputs) == expected


@pytest.mark.parametrize("family", [*MOE_FAMILIES, "gpt-oss"])
def test_moe_float32_matches_transformers_on_the_gpu(
    family, tiny_models, hf_greedy, gpu_llm, hf_on_gpu
):
    """Mixtures of experts run eagerly (their expert grouping has data-dependent shapes)."""
    path, hf_model = tiny_models.get(family)
    hf = hf_on_gpu(hf_model, torch.float32)
    prompts = random_prompts(PROMPT_LENGTHS)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    llm = gpu_llm(str(path), dtype="float32", num_gpu_blocks_override=BLOCKS)
    assert runner_of(llm).cuda_graphs is None
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    assert token_ids(outputs) == expected


def test_bfloat16_greedy_matches_transformers_for_16_tokens(
    smol_dir, smol_tokenizer, hf_greedy, gpu_llm, hf_on_gpu
):
    from transformers import AutoModelForCausalLM

    from llmctl.engine.model_loader.default_model import default_model_path

    gguf = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = hf_on_gpu(hf, torch.bfloat16)
    prompts = [smol_tokenizer.encode(text) for text in BF16_PROMPTS]
    # The float path on the GGUF's dequantized weights, as transformers loads them.
    llm = gpu_llm(None, dtype="bfloat16", num_gpu_blocks_override=BLOCKS, gguf_dequantize=True)

    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )

    for prompt, got in zip(prompts, token_ids(outputs), strict=True):
        expected = hf_greedy(hf, prompt, 16)
        assert got == expected, _divergence(hf, prompt, expected, got)


def _divergence(hf, prompt: list[int], expected: list[int], got: list[int]) -> str:
    """Where the two greedy runs part, and how close transformers' own choice was there."""
    step = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
    ids = torch.tensor([prompt + expected[:step]], device=hf.device)
    with torch.no_grad():
        logits = hf(ids).logits[0, -1].float()
    return (
        f"first difference at token {step}: transformers {expected[step]} (logit "
        f"{logits[expected[step]]:.4f}), llmctl {got[step]} (logit {logits[got[step]]:.4f})"
    )


def test_bundled_q4_1_natively_on_the_gpu_matches_its_dequantized_weights(smol_dir, gpu_llm):
    """The GGUF's blocks stay packed on the GPU: 4 prompts x 32 tokens equal the float path
    on the dequantized weights (or part where the reference's logit gap is below 1e-3)."""
    prompts = BF16_PROMPTS[:4]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    common = dict(dtype="float32", num_gpu_blocks_override=BLOCKS)
    llm = gpu_llm(None, **common)
    assert llm.llm_engine.config.model_config.quantization.gguf_types == ("Q4_1", "Q8_0")
    assert runner_of(llm).cuda_graphs is not None  # decode replays graphs with the Triton matmul
    native = llm.generate(prompts, greedy, use_tqdm=False)
    reference = gpu_llm(None, gguf_dequantize=True, **common).generate(
        prompts, greedy, use_tqdm=False
    )
    assert_same_greedy(native, reference)
