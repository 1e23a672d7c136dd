"""benchmarks/gpu_check.py as a user runs it: on this CPU-only machine it stops with its "no GPU"
message and JSON; with --dry-run every stage runs on the CPU at toy sizes and the JSON holds each
stage's figures (so a lent GPU's minutes are not lost to a bug in the check itself)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.py"
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


def test_without_a_gpu_it_says_so_and_measures_nothing(tmp_path):
    run = subprocess.run(
        [sys.executable, str(CHECK), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert run.returncode == 2, run.stderr
    assert "gpu_check: no GPU: torch" in run.stdout
    assert "sees no CUDA device" in run.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["gpu"] is None and report["stages"] == {}
    assert report["error"].startswith("no GPU")


class _Background:
    """A command run to its end in a thread: its output, and its wall time from start to exit
    (measured when it exits, not when a test asks)."""

    def __init__(self, argv: list[str]) -> None:
        self.began = time.monotonic()
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        self.stdout, self.stderr = self.process.communicate()
        self.wall = time.monotonic() - self.began

    def join(self, timeout: float) -> subprocess.CompletedProcess:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.process.kill()
            self.thread.join()
            raise subprocess.TimeoutExpired(self.process.args, timeout)
        return subprocess.CompletedProcess(
            self.process.args, self.process.returncode, self.stdout, self.stderr
        )


@pytest.fixture(scope="module")
def budget_check(tmp_path_factory):
    """The budget test's check (see there), started when first asked for: the dry run's test
    asks, so that this check, which keeps one core busy until its engine stage's deadline, runs
    beside that dry run (one core most of the time) instead of after it. It ends within its
    budget whatever runs beside it (the budget test asserts that); teardown waits for it."""
    model = tmp_path_factory.mktemp("budget") / "tall"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 4000}))
    out = model.parent / "out"
    check = _Background(
        [sys.executable, str(CHECK), "--dry-run", "--out", str(out), "--budget", "20",
         "--stages", "env,engine,floor", "--model", str(model)]
    )  # fmt: skip
    yield check, out
    check.join(timeout=120)


def test_a_dry_run_runs_every_stage_and_writes_their_figures(tmp_path, budget_check):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--out", str(out), "--model", str(model),
         "--budget", "400"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip

    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert run.returncode == 0, run.stdout + run.stderr + log
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    assert list(stages) == [
        "env", "bandwidth", "floor", "engine", "attention", "transformers", "quantized_mm",
        "cuda_tests",
    ]  # fmt: skip
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(stages, "ok")
    engine = stages["engine"]
    assert set(engine["decode"]) == {"1", "4"}
    for row in engine["decode"].values():
        assert row["ms_per_step"] > 0 and row["bytes_per_step"] > 0
        assert row["host_gap_ms_per_step"] >= 0
    assert set(engine["prefill"]) == {"32", "64"}
    assert stages["cuda_tests"]["counts"]["tests"] > 0  # collected (and skipped: no GPU)
    quantized = stages["quantized_mm"]["rows"]
    assert set(quantized) == {"m1", "m80"}
    assert all(r["max_abs_error"] < 1e-3 for rows in quantized.values() for r in rows.values())
    assert set(stages["transformers"]["generate"]) == {"1", "4"}
    assert (out / "gpu_check.log").is_file() and len(list(out.iterdir())) == 2  # JSON and log


def test_the_budget_holds_whatever_the_stages_do(budget_check):
    """An engine stage that cannot finish in what a 20 s budget leaves it (a model of 4,000
    layers: seconds per decode step on any CPU) is killed at its deadline (or not started),
    recorded so, and the check ends in time."""
    check, out = budget_check
    run = check.join(timeout=120)
    wall = check.wall

    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["elapsed_s"] <= 20
    assert wall < 20 + 15  # the interpreter's start and exit around the budget
    assert report["stages"]["env"]["status"] == "ok"
    assert report["stages"]["engine"]["status"].startswith(("timed out", "skipped"))


def test_a_dry_run_of_a_model_of_billions_is_refused_naming_the_option(tmp_path):
    """The dry run builds its model on the CPU: Llama-3.1-8B (the default) in float32 took this
    machine's 24 GiB and was killed without a word."""
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Llama-3.1-8B (8.0 B parameters)" in run.stdout and "--model DIR" in run.stdout
    assert "8.0 B parameters" in json.loads((out / "gpu_check.json").read_text())["error"]
