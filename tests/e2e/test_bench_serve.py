"""`llmctl bench serve` against a real `llmctl serve` of a tiny random Llama: every request
completes, the token counts are the workload's, and the latencies come under vLLM's keys."""

from __future__ import annotations

import json
import subprocess

from e2e.conftest import LLMCTL


def test_bench_serve_measures_a_running_server(server_factory, tiny_models, tmp_path):
    server = server_factory(str(tiny_models.path("llama")), "--dtype", "float32")
    out = tmp_path / "serve.json"
    run = subprocess.run(
        [LLMCTL, "-q", "bench", "serve", "--base-url", server.url, "--num-prompts", "6",
         "--random-input-len", "10", "--random-output-len", "5", "--ignore-eos",
         "--max-concurrency", "2", "--request-rate", "50", "--output-json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip

    assert run.returncode == 0, run.stderr
    assert "Serving benchmark" in run.stdout
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["errors"] == [""] * 6
    assert data["total_input_tokens"] == 60 and data["total_output_tokens"] == 30
    assert data["output_lens"] == [5] * 6
    assert all(len(itls) == 4 for itls in data["itls"])  # 5 tokens: 4 gaps after the first
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert data[f"{stat}_{metric}_ms"] >= 0
    assert data["p99_e2el_ms"] >= data["p50_e2el_ms"]
    assert data["mean_e2el_ms"] >= data["mean_ttft_ms"] > 0
