"""The `llmctl` entry point: version, help, the console script, and that startup stays light."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

LLMCTL = Path(sys.executable).with_name("llmctl")  # the console script in this environment


def test_version_prints_package_version(invoke):
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"llmctl {version('llmctl')}\n"


def test_console_script_version():
    proc = subprocess.run([LLMCTL, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"llmctl {version('llmctl')}\n"


def test_console_script_reports_errors_without_traceback():
    # Sampling parameters are checked before the model loads, so this stays fast.
    proc = subprocess.run(
        [LLMCTL, "generate", "-p", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "error: temperature must be non-negative, got -1.0" in proc.stderr
    assert "hint: use 0 for greedy decoding" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_help_and_version_do_not_import_heavy_modules():
    script = textwrap.dedent(
        """
        import sys
        from typer.testing import CliRunner
        from llmctl.cli.main import app

        runner = CliRunner()
        for args in (
            ["--version"],
            ["--help"],
            ["generate", "--help"],
            ["serve", "--help"],
            ["plan", "--help"],
            ["plan", "Llama-3.1-70B", "--json"],
            ["plan", "--list-models"],
        ):
            result = runner.invoke(app, args, catch_exceptions=False)
            assert result.exit_code == 0, (args, result.output)
        heavy = {"torch", "transformers", "safetensors", "gguf", "numpy"}
        engine = {"llmctl.engine.entrypoints.llm", "llmctl.engine.core.llm_engine"}
        print(sorted({m for m in sys.modules if m.split(".")[0] in heavy or m in engine}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_help_lists_generate(invoke):
    result = invoke("--help")
    assert result.exit_code == 0
    assert "generate" in result.stdout
    assert "Generate completions for one prompt or a batch" in result.stdout


def test_generate_help_shows_vllm_option_names(invoke):
    result = invoke("generate", "--help", env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in (
        "--prompt",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--seed",
        "--stop",
        "--n",
        "--ignore-eos",
        "--chat",
        "--dtype",
        "--max-model-len",
        "--kv-cache-space-gib",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--json",
    ):
        assert option in result.stdout, option
