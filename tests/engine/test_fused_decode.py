"""The CPU decode step in one C++ call (engine/kernels/cpu/fused_decode.py) against the module path.

Every family it takes (Llama with GQA, Mistral's sliding window, Qwen2's QKV bias, float
weights prepacked for oneDNN, int4/int8 packed weights, GGUF blocks), in float32 and bfloat16,
must give the module path's greedy tokens, alone and in a batch, and each test checks that the
fused stack really ran (and, under LLMCTL_FUSED_DECODE=0, that it did not): a silently skipped
fast path would pass otherwise.
"""

from __future__ import annotations

import pytest
from support import assert_same_greedy, random_prompts
from test_quantized import tiny_prompts, write_tiny_gguf

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.kernels.cpu.fused_decode import DecodeStack, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the kernel")

TINY = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


def fused_stack(llm: LLM):
    """The decoder's DecodeStack after a generate, or what it decided instead."""
    model = llm.llm_engine.executor.worker.model_runner.model
    return model.model.__dict__.get("_fused_decode_stack")


def run(path, monkeypatch, fused: bool, prompts, **kw):
    monkeypatch.setenv("LLMCTL_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(str(path), **{**TINY, **kw})
    with llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stack = fused_stack(llm)
    assert isinstance(stack, DecodeStack) if fused else type(stack).__name__ == "_NoStack"
    return outputs


def stack_rows(monkeypatch) -> list[int]:
    """The rows of every decode step the fused stack runs from here on."""
    rows: list[int] = []
    call = DecodeStack.__call__

    def counted(self, hidden, *args):
        rows.append(hidden.shape[0])
        return call(self, hidden, *args)

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    return rows


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_fused_decode_gives_the_module_paths_tokens(family, quantization, tiny_models, monkeypatch):
    path = tiny_models.path(family)
    # One alone, then a batch of 5 with different lengths (Mistral's window of 24 is crossed).
    for prompts in (random_prompts([7]), random_prompts([3, 9, 17, 30, 40], seed=1)):
        fused = run(path, monkeypatch, True, prompts, quantization=quantization)
        modules = run(path, monkeypatch, False, prompts, quantization=quantization)
        assert_same_greedy(fused, modules)


@pytest.mark.parametrize(
    "family, quantization", [("llama", None), ("qwen2", None), ("llama", "int4")]
)
def test_fused_decode_in_bfloat16_gives_the_module_paths_bits(
    family, quantization, tiny_models, monkeypatch
):
    # The stack rounds where torch's bfloat16 ops round and calls the module path's matmul ops
    # (a packed weight's decode kernel up to BF16_SMALL_BATCH rows, its bfloat16 tiles above
    # where the CPU has them): the same tokens and logprobs, alone and in a batch of 5.
    path = tiny_models.path(family)
    kw = dict(quantization=quantization, dtype="bfloat16")
    for prompts in (random_prompts([7]), random_prompts([3, 9, 17, 30, 40], seed=1)):
        fused = run(path, monkeypatch, True, prompts, **kw)
        modules = run(path, monkeypatch, False, prompts, **kw)
        for a, b in zip(fused, modules, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_batch_of_40_decodes_fused_in_bfloat16(quantization, tiny_models, monkeypatch):
    # Above SMALL_BATCH rows the stack takes a step when its matmuls are the module path's at any
    # batch (float weights through oneDNN; packed weights through their bfloat16 tiles): 40
    # sequences decode in one call per step, with the module path's tokens and logprobs.
    from llmctl.engine.kernels.cpu import quantized_matmul

    if quantization and not quantized_matmul._bf16_tiles():
        pytest.skip("this CPU has no bfloat16 tiles (AMX or AVX512-BF16): its stack stops at 24")
    rows = stack_rows(monkeypatch)
    path = tiny_models.path("llama")
    prompts = random_prompts([3 + (7 * i) % 37 for i in range(40)], seed=2)
    kw = dict(quantization=quantization, dtype="bfloat16")
    fused = run(path, monkeypatch, True, prompts, **kw)
    assert max(rows) == 40  # every sequence in one decode step of the stack
    modules = run(path, monkeypatch, False, prompts, **kw)
    for a, b in zip(fused, modules, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("int8", [False, True], ids=["float32-tiles", "int8-activations"])
def test_a_batch_of_70_decodes_fused_in_float32(int8, tiny_models, monkeypatch):
    # Above SMALL_BATCH float32 rows a packed weight runs its float32 tiles in the stack as in
    # the module path, and from INT8_FLOAT32_BATCH rows int8 activations where the model's
    # weights take them (the AVX2 path's dtype auto, forced here on any CPU that builds the
    # kernel): 70 sequences decode in one call per step, with the module path's tokens.
    from llmctl.engine import platform
    from llmctl.engine.kernels.cpu import quantized_matmul

    op = quantized_matmul._kernel()
    if op is None:
        pytest.skip("the quantized matmul kernel is not built here")
    int8_rows: list[int] = []
    if int8:
        if not op.int8_f32_built():
            pytest.skip("this build has no AVX2 int8 GEMM (the CPU lacks AVX2 and FMA)")
        monkeypatch.setattr(quantized_matmul, "float32_int8", lambda op: True)
        monkeypatch.setattr(platform, "int8_activations", lambda dtype, device: True)
        act_mm = quantized_matmul.PackedLinearWeight._int8_act_mm

        def counted_mm(self, op, x):
            int8_rows.append(x.shape[0])
            return act_mm(self, op, x)

        monkeypatch.setattr(quantized_matmul.PackedLinearWeight, "_int8_act_mm", counted_mm)
    rows = stack_rows(monkeypatch)
    path = tiny_models.path("llama")
    prompts = random_prompts([3 + (7 * i) % 37 for i in range(70)], seed=3)
    fused = run(path, monkeypatch, True, prompts, quantization="int4")
    assert max(rows) == 70  # every sequence in one decode step of the stack
    int8_rows.clear()
    modules = run(path, monkeypatch, False, prompts, quantization="int4")
    assert_same_greedy(fused, modules)
    # the module path's decode steps (70 rows) took int8 activations, and only where forced (the
    # stack calls the same op from C++, out of Python's sight)
    assert (70 in int8_rows) == int8


def test_fused_decode_on_gguf_blocks_matches_the_module_path(tmp_path, monkeypatch):
    # Q4_K_M's mix: a layer's qkv is Q4_K rows then Q6_K rows, two parts of one linear.
    tiny_gguf = tmp_path / "tiny-q4_k_m.gguf"
    types = {"default": "Q4_K", "token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}
    write_tiny_gguf(tiny_gguf, types=types, hidden=256)
    fused = run(tiny_gguf, monkeypatch, True, tiny_prompts(), skip_tokenizer_init=True)
    modules = run(tiny_gguf, monkeypatch, False, tiny_prompts(), skip_tokenizer_init=True)
    assert_same_greedy(fused, modules)


def test_a_pipeline_stage_runs_its_own_layers_fused(tiny_models, monkeypatch):
    path = tiny_models.path("llama")
    prompts = random_prompts([5, 12])
    # pp=2 over mp workers: each stage's worker builds the stack of its layers (the second
    # stage starting from the first's residual); the tokens say whether both were right.
    monkeypatch.setenv("LLMCTL_FUSED_DECODE", "1")
    with LLM(str(path), pipeline_parallel_size=2, **TINY) as llm:
        split = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_greedy(split, run(path, monkeypatch, False, prompts))


def test_positions_and_slots_outside_the_tables_are_refused(tiny_models, monkeypatch):
    import torch

    monkeypatch.setenv("LLMCTL_FUSED_DECODE", "1")
    with LLM(str(tiny_models.path("llama")), **TINY) as llm:
        llm.generate(random_prompts([4]), GREEDY, use_tqdm=False)
        stack = fused_stack(llm).stack
        hidden = torch.zeros(1, 64)
        tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
        one = torch.zeros(1, dtype=torch.long)
        with pytest.raises(RuntimeError, match="outside the rotary table"):
            stack.forward(hidden, None, one + 10**6, one, tables, lens, None, None)
        with pytest.raises(RuntimeError, match="outside the KV cache"):
            stack.forward(hidden, None, one, one + 10**9, tables, lens, None, None)
