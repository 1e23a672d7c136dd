"""The real bundled model: SmolLM2-135M-Instruct from its GGUF, token-exact against Hugging Face
transformers' own GGUF loader (the same dequantized weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.model_loader.default_model import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def smol():
    # No model named: the bundled default. float32, to compare with transformers' float32.
    return LLM(use_tqdm_on_load=False, dtype="float32")


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoModelForCausalLM

    gguf = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()


def test_default_model_is_smollm2(smol):
    config = smol.llm_engine.config.model_config
    assert config.served_model_name == "SmolLM2-135M-Instruct"
    assert config.hf_config.num_hidden_layers == 30
    assert config.num_attention_heads == 9 and config.num_kv_heads == 3
    assert config.dtype == "float32"


def test_four_prompts_match_transformers(smol, hf_smol, hf_greedy):
    tokenizer = smol.get_tokenizer()
    outputs = smol.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == hf_greedy(hf_smol, ids, 32)


def test_chat_uses_the_gguf_chat_template(smol, hf_smol, hf_greedy):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    tokenizer = smol.get_tokenizer()
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    expected = hf_greedy(hf_smol, ids, 24)
    completion = out.outputs[0]
    # Stops at <|im_end|> (the model's EOS) or after 24 tokens, like transformers would.
    assert completion.token_ids == expected[: len(completion.token_ids)]
    assert "Paris" in completion.text
    if completion.finish_reason == "stop":
        assert completion.token_ids[-1] == tokenizer.eos_token_id
        assert "<|im_end|>" not in completion.text


@pytest.mark.parametrize("dequantize", [False, True], ids=["gguf", "dequantized"])
def test_default_dtype_on_this_cpu_still_answers(dequantize):
    """dtype="auto": bfloat16 where the CPU has it natively, float32 elsewhere, for the GGUF's
    quantized weights and for them dequantized alike; either gives a sensible answer."""
    from llmctl.engine.platform import cpu_has_native_bf16

    llm = LLM(use_tqdm_on_load=False, kv_cache_space_gib=0.5, gguf_dequantize=dequantize)
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert llm.llm_engine.config.model_config.dtype == expected
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text


@pytest.fixture(scope="module")
def single(smol) -> list[list[int]]:
    """The one-process engine's greedy tokens: what each parallel layout must give."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in smol.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_parallel_size": 2},  # uneven: 9 heads / 3 KV heads -> 6+3 and 2+1
        {"pipeline_parallel_size": 2},
    ],
    ids=["tp2-uneven", "pp2"],
)
def test_parallel_layouts_match_one_process(single, layout):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.5,
        distributed_executor_backend="mp",
        **layout,
    ) as llm:
        parallel = llm.generate(PROMPTS, params, use_tqdm=False)
        info = llm.llm_engine.executor.rank_info()
    assert [o.outputs[0].token_ids for o in parallel] == single
    if "tensor_parallel_size" in layout:
        # Rank 0 holds two of the three KV-head groups, rank 1 one: uneven weights.
        assert info[0]["weight_bytes"] > info[1]["weight_bytes"]
    else:
        assert [r["layers"] for r in info] == [(0, 15), (15, 30)]


def test_a_rank_on_another_node_reads_the_gguf_there(tmp_path, monkeypatch):
    """The driver wrote the GGUF's config into its own cache, and no converted weights anywhere;
    a Ray rank on another node (no such directory or file path there) resolves the model it
    names again and reads the weights from the GGUF file itself."""
    import dataclasses

    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.model_loader.loader import local_gguf_path

    gguf = str(default_model_path())
    model_config = EngineArgs(model=gguf).create_engine_config().model_config
    assert model_config.gguf_file == gguf
    assert not any(p.suffix == ".safetensors" for p in Path(model_config.path).iterdir())
    assert local_gguf_path(model_config) == gguf  # the driver's own node
    elsewhere = dataclasses.replace(
        model_config,
        path=str(tmp_path / "driver-cache" / "smol"),
        gguf_file=str(tmp_path / "driver-only" / "smol.gguf"),
    )
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "this-node"))
    assert local_gguf_path(elsewhere) == gguf


@pytest.mark.parametrize(
    "flags, dtype",
    [
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16"),
        ({"avx2", "fma"}, "float32"),
    ],
)
def test_the_bundled_gguf_takes_the_float_paths_dtype(monkeypatch, flags, dtype):
    """dtype "auto" follows the CPU path for quantized weights as for float ones: bfloat16 where
    the CPU has native bfloat16 (the quantized matmuls run bfloat16 tiles there), float32 on
    AVX2."""
    from llmctl.engine import platform
    from llmctl.engine.config.engine_args import EngineArgs

    monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
    gguf = str(default_model_path())
    assert EngineArgs(model=gguf).create_engine_config().model_config.dtype == dtype
    dequantized = EngineArgs(model=gguf, gguf_dequantize=True).create_engine_config()
    assert dequantized.model_config.dtype == dtype
