"""One exit path: an LLMCtlError is one `error:` line and one `hint:` line on stderr, exit 1."""

from __future__ import annotations

import re

import pytest

SMALL_CACHE = ("--kv-cache-space-gib", "0.01")
LONG_PROMPT = "word " * 100  # about 100 tokens


def _error_lines(stderr: str) -> tuple[str, str]:
    [error] = [line for line in stderr.splitlines() if line.startswith("error: ")]
    [hint] = [line for line in stderr.splitlines() if line.startswith("hint: ")]
    return error, hint


def test_missing_model_names_the_path_and_a_hint(invoke, tmp_path):
    missing = tmp_path / "no-such-model"

    result = invoke("generate", str(missing), "-p", "hi")

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error == f"error: model '{missing}' not found"
    assert hint.startswith("hint: name a local Hugging Face directory")
    assert "llmctl never downloads models" in hint  # the whole hint on one line, unwrapped
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_negative_temperature_names_temperature(invoke, tiny_llama):
    result = invoke("generate", tiny_llama, "-p", "hi", "--temperature", "-1")

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error == "error: temperature must be non-negative, got -1.0"
    assert hint == "hint: use 0 for greedy decoding or a positive value such as 0.7"


def test_unknown_dtype_names_dtype(invoke, tiny_llama):
    result = invoke("generate", tiny_llama, "-p", "hi", "--dtype", "foo", *SMALL_CACHE)

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert error == "error: unknown dtype 'foo'"
    assert hint.startswith("hint: use one of auto, float32, bfloat16, float16")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--block-size", "3", "error: block_size must be a positive power of two, got 3"),
        ("--max-num-seqs", "0", "error: max_num_seqs must be at least 1, got 0"),
        (
            "--max-num-batched-tokens",
            "0",
            "error: max_num_batched_tokens must be at least 1, got 0",
        ),
        ("--kv-cache-space-gib", "0", "error: kv_cache_space_gib must be positive, got 0.0"),
        (
            "--max-model-len",
            "100000",
            "error: max_model_len=100000 exceeds the model's maximum length of 256 tokens",
        ),
    ],
)
def test_bad_engine_option_names_the_setting(invoke, tiny_llama, option, value, message):
    result = invoke("generate", tiny_llama, "-p", "hi", *SMALL_CACHE, option, value)

    assert result.exit_code == 1
    error, _ = _error_lines(result.stderr)
    assert error == message


def test_prompt_longer_than_max_model_len(invoke, tiny_llama):
    result = invoke(
        "generate", tiny_llama, "-p", LONG_PROMPT, "--max-model-len", "32", *SMALL_CACHE
    )

    assert result.exit_code == 1
    error, hint = _error_lines(result.stderr)
    assert re.fullmatch(
        r"error: the prompt has \d+ tokens, but max_model_len is 32: no room is left to generate",
        error,
    )
    assert hint == "hint: shorten the prompt below 32 tokens, or raise --max-model-len"
    assert result.stdout == ""


def test_rejected_prompt_in_a_batch_keeps_the_valid_completions(invoke, tiny_llama):
    result = invoke(
        "generate",
        tiny_llama,
        "-p",
        "hi",
        "-p",
        LONG_PROMPT,
        "--max-model-len",
        "32",
        "--max-tokens",
        "3",
        *SMALL_CACHE,
    )

    assert result.exit_code == 1
    assert result.stdout.startswith("Prompt: hi\nCompletion: ")
    assert LONG_PROMPT not in result.stdout
    error, _ = _error_lines(result.stderr)
    assert error.startswith(
        "error: 1 of 2 prompts rejected; the prompt at index 1 (counting from 0): the prompt has "
    )


def test_debug_shows_the_traceback(invoke, tmp_path):
    missing = tmp_path / "no-such-model"

    result = invoke("--debug", "generate", str(missing), "-p", "hi")

    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert "ModelNotFoundError" in result.stderr
    error, _ = _error_lines(result.stderr)
    assert error == f"error: model '{missing}' not found"


def test_error_line_is_red(invoke):
    result = invoke("generate", "-p", "hi", "--temperature", "-1", env={"FORCE_COLOR": "1"})

    assert result.exit_code == 1
    [line] = [line for line in result.stderr.splitlines() if "temperature must be" in line]
    assert re.match(r"\x1b\[[0-9;]*31m", line), repr(line)  # starts in red (ANSI 31)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate"], "Missing option '--prompt'"),
        (["generate", "-p", "hi", "--temperature", "warm"], "Invalid value for '--temperature'"),
        (["--log-level", "loud", "generate", "-p", "hi"], "'loud' is not one of"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
)
def test_usage_errors_keep_clicks_exit_code_2(invoke, args, message):
    result = invoke(*args, env={"COLUMNS": "200"})  # Click's message on one line

    assert result.exit_code == 2
    assert message in result.stderr
    assert not any(line.startswith("error: ") for line in result.stderr.splitlines())
