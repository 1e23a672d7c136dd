"""`llmctl generate` on a tiny random Llama: what it prints equals what LLM.generate returns."""

from __future__ import annotations

import json

import pytest

from llmctl.engine import SamplingParams

SMALL_CACHE = ("--kv-cache-space-gib", "0.01")  # fast to allocate; outputs do not depend on it
PROMPT = "Hello, my name is"
OTHER_PROMPT = "The capital of France is"


def _expected(llm, prompt: str, **params) -> list:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs


def test_greedy_completion_is_printed_after_its_prompt(invoke, tiny_llama, reference_llm):
    [expected] = _expected(reference_llm, PROMPT, temperature=0, max_tokens=16)

    result = invoke("generate", tiny_llama, "-p", PROMPT, "--max-tokens", "16", *SMALL_CACHE)

    assert result.exit_code == 0, result.output
    assert result.stdout == f"Prompt: {PROMPT}\nCompletion: {expected.text}\n\n"


def test_json_output_for_a_batch_in_prompt_order(invoke, tiny_llama, reference_llm):
    expected = [
        _expected(reference_llm, p, temperature=0, max_tokens=8)[0] for p in (PROMPT, OTHER_PROMPT)
    ]

    result = invoke(
        "generate",
        tiny_llama,
        "-p",
        PROMPT,
        "-p",
        OTHER_PROMPT,
        "--max-tokens",
        "8",
        "--json",
        *SMALL_CACHE,
    )

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [
        {
            "prompt": prompt,
            "index": 0,
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": "length",
        }
        for prompt, completion in zip((PROMPT, OTHER_PROMPT), expected, strict=True)
    ]
    assert [len(r["token_ids"]) for r in json.loads(result.stdout)] == [8, 8]


def test_sampling_options_reach_the_sampler(invoke, tiny_llama, reference_llm):
    params = dict(temperature=0.8, top_p=0.9, top_k=5, min_p=0.01, seed=7, n=3, max_tokens=6)
    expected = _expected(reference_llm, PROMPT, **params)

    result = invoke(
        "generate",
        tiny_llama,
        "-p",
        PROMPT,
        "--json",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "5",
        "--min-p",
        "0.01",
        "--seed",
        "7",
        "--n",
        "3",
        "--max-tokens",
        "6",
        *SMALL_CACHE,
    )

    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [(r["index"], r["text"], r["token_ids"]) for r in records] == [
        (c.index, c.text, c.token_ids) for c in expected
    ]
    # A different seed samples something else: the seed really is used.
    assert records != json.loads(
        invoke(
            "generate",
            tiny_llama,
            "-p",
            PROMPT,
            "--json",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--min-p",
            "0.01",
            "--seed",
            "8",
            "--n",
            "3",
            "--max-tokens",
            "6",
            *SMALL_CACHE,
        ).stdout
    )


def test_several_completions_are_numbered(invoke, tiny_llama, reference_llm):
    expected = _expected(reference_llm, PROMPT, temperature=1.0, seed=3, n=2, max_tokens=4)

    result = invoke(
        "generate",
        tiny_llama,
        "-p",
        PROMPT,
        "--temperature",
        "1",
        "--seed",
        "3",
        "--n",
        "2",
        "--max-tokens",
        "4",
        *SMALL_CACHE,
    )

    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"Prompt: {PROMPT}\n"
        f"Completion 1/2: {expected[0].text}\n"
        f"Completion 2/2: {expected[1].text}\n\n"
    )


def test_stop_string_ends_the_text(invoke, tiny_llama, reference_llm):
    [greedy] = _expected(reference_llm, PROMPT, temperature=0, max_tokens=16)
    stop = greedy.text.split()[2]  # a word from the middle of the greedy completion

    result = invoke(
        "generate",
        tiny_llama,
        "-p",
        PROMPT,
        "--stop",
        stop,
        "--max-tokens",
        "16",
        "--json",
        *SMALL_CACHE,
    )

    assert result.exit_code == 0, result.output
    [record] = json.loads(result.stdout)
    assert record["finish_reason"] == "stop"
    assert record["text"] == greedy.text[: greedy.text.index(stop)]


def test_chat_wraps_the_prompt_as_a_user_message(invoke, tiny_llama, reference_llm):
    conversation = [{"role": "user", "content": PROMPT}]
    params = SamplingParams(temperature=0, max_tokens=8)
    [expected] = reference_llm.chat(conversation, params, use_tqdm=False)[0].outputs
    [plain] = _expected(reference_llm, PROMPT, temperature=0, max_tokens=8)
    assert expected.token_ids != plain.token_ids  # otherwise this test could not tell them apart

    result = invoke(
        "generate", tiny_llama, "-p", PROMPT, "--chat", "--max-tokens", "8", "--json", *SMALL_CACHE
    )

    assert result.exit_code == 0, result.output
    [record] = json.loads(result.stdout)
    assert (record["prompt"], record["text"], record["token_ids"]) == (
        PROMPT,
        expected.text,
        expected.token_ids,
    )


def test_engine_log_lines_are_shown_on_stderr(invoke, tiny_llama):
    result = invoke(
        "generate",
        tiny_llama,
        "-p",
        PROMPT,
        "--max-tokens",
        "2",
        "--block-size",
        "8",
        "--max-model-len",
        "64",
        *SMALL_CACHE,
    )

    assert result.exit_code == 0, result.output
    assert "# KV cache blocks: " in result.stderr
    assert "(block size 8)" in result.stderr
    assert "KV cache size: " in result.stderr
    assert "Maximum concurrency for 64 tokens per request: " in result.stderr
    assert "KV cache" not in result.stdout


@pytest.mark.parametrize("quiet", [["-q"], ["--quiet"], ["--log-level", "warning"]])
def test_quiet_hides_info_lines_but_not_the_completion(invoke, tiny_llama, quiet):
    result = invoke(*quiet, "generate", tiny_llama, "-p", PROMPT, "--max-tokens", "2", *SMALL_CACHE)

    assert result.exit_code == 0, result.output
    assert "KV cache" not in result.stderr
    assert result.stdout.startswith(f"Prompt: {PROMPT}\nCompletion: ")


@pytest.mark.slow
def test_default_model_when_no_model_is_named(invoke):
    result = invoke(
        "generate",
        "-p",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "16",
        "--kv-cache-space-gib",
        "1",
    )

    assert result.exit_code == 0, result.output
    assert "# KV cache blocks: " in result.stderr
    assert "KV cache size: " in result.stderr
    assert "Maximum concurrency for 8,192 tokens per request: " in result.stderr
    prompt_line, completion_line = result.stdout.splitlines()[:2]
    assert prompt_line == "Prompt: What is the capital of France?"
    assert completion_line.startswith("Completion: ")
    assert "Paris" in completion_line


def test_options_reach_llm_under_engine_args_names(invoke, monkeypatch):
    # The parse step alone: a recording stand-in for LLM (the runs above use the real engine).
    calls = {}

    class RecordingLLM:
        def __init__(self, model, *, use_tqdm_on_load, **kwargs):
            calls["init"] = (model, use_tqdm_on_load, kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls["shutdown"] = True

        def generate(self, prompts, params, use_tqdm):
            calls["generate"] = (prompts, params, use_tqdm)
            return [None] * len(prompts)

    monkeypatch.setattr("llmctl.engine.entrypoints.llm.LLM", RecordingLLM)
    result = invoke(
        "-q",
        "generate",
        "some/model",
        "-p",
        "a",
        "-p",
        "b",
        "--ignore-eos",
        "--stop",
        "x",
        "--stop",
        "y",
        "--dtype",
        "bf16",
        "--max-model-len",
        "128",
        "--kv-cache-space-gib",
        "2",
        "--block-size",
        "32",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "512",
        "--no-enable-prefix-caching",
        "-tp",
        "2",
        "-pp",
        "3",
        "--distributed-executor-backend",
        "ray",
        "--pipeline-layer-partition",
        "1,2,1",
    )

    assert result.exit_code == 0, result.output
    assert calls["init"] == (
        "some/model",
        False,  # -q: no progress bars
        dict(
            dtype="bf16",
            max_model_len=128,
            kv_cache_space_gib=2.0,
            block_size=32,
            max_num_seqs=4,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,
            tensor_parallel_size=2,
            pipeline_parallel_size=3,
            distributed_executor_backend="ray",
            pipeline_layer_partition="1,2,1",
        ),
    )
    prompts, params, use_tqdm = calls["generate"]
    assert prompts == ["a", "b"] and use_tqdm is False
    assert params == SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=["x", "y"])
    assert calls["shutdown"]


def test_tensor_parallel_generation_matches_one_process(invoke, tiny_llama, reference_llm):
    args = ("generate", tiny_llama, "-p", "Hello there", "--max-tokens", "12", "--dtype", "float32")
    args = (*args, *SMALL_CACHE)
    single = invoke(*args)
    parallel = invoke(*args, "-tp", "2", "--distributed-executor-backend", "mp")
    assert single.exit_code == 0 and parallel.exit_code == 0, parallel.output
    assert parallel.stdout == single.stdout
