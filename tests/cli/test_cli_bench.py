"""`llmctl bench throughput` and `latency` on a tiny random Llama, as a user runs them: the
table, and the JSON under vLLM's key names with the device's limit; `bench serve`'s typed errors
(its run against a real server: tests/e2e/test_bench_serve.py)."""

from __future__ import annotations

import json

from llmctl.engine.distributed.ports import free_port

SMALL = ("--kv-cache-space-gib", "0.05", "--dtype", "float32")


def test_throughput_reports_vllm_keys_and_the_fraction_of_the_limit(invoke, tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    result = invoke(
        "-q", "bench", "throughput", tiny_llama, "--num-prompts", "6", "--input-len", "12",
        "--output-len", "5", "--output-json", str(out), *SMALL,
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    assert "Throughput benchmark" in result.stdout and "Fraction of the limit" in result.stdout
    data = json.loads(out.read_text())
    assert data["num_requests"] == 6
    assert data["total_num_tokens"] == 6 * (12 + 5)
    assert data["total_output_tokens"] == 30
    assert data["tokens_per_second"] == data["total_num_tokens"] / data["elapsed_time"]
    assert data["requests_per_second"] == 6 / data["elapsed_time"]
    limit = data["device_limit"]
    assert limit["source"] == "measured STREAM-like + matmul" and limit["bandwidth"] > 0
    assert data["fraction_of_limit"] > 0
    assert data["decode_bytes"] > 0 and data["prefill_flops"] > 0


def test_latency_reports_percentiles_and_decode_against_bandwidth(invoke, tiny_llama, tmp_path):
    out = tmp_path / "latency.json"
    result = invoke(
        "-q", "bench", "latency", tiny_llama, "--batch-size", "2", "--input-len", "8",
        "--output-len", "6", "--num-iters-warmup", "1", "--num-iters", "3",
        "--output-json", str(out), *SMALL,
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["latencies"]) == 3
    assert data["avg_latency"] == sum(data["latencies"]) / 3
    assert set(data["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    decode = data["decode"]  # measured inside each iteration: there on a busy machine too
    assert decode["steps"] == 5
    assert 0 < decode["ms_per_step"] * 5 < data["avg_latency"] * 1000
    assert (
        decode["fraction_of_bandwidth"]
        == decode["achieved_bandwidth"] / (data["device_limit"]["bandwidth"])
    )
    assert data["prefill"]["fraction_of_peak"] > 0


def test_a_dataset_other_than_random_is_refused(invoke, tiny_llama):
    result = invoke("bench", "throughput", tiny_llama, "--dataset-name", "sharegpt")
    assert result.exit_code == 1
    assert "unknown dataset 'sharegpt'" in result.stderr
    assert "--dataset-name random" in result.stderr


def test_serve_without_a_server_says_so(invoke):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = invoke("bench", "serve", "--base-url", url, "--num-prompts", "2")
    assert result.exit_code == 1
    assert f"cannot reach {url}" in result.stderr
    assert "llmctl serve" in result.stderr


def test_serve_flags_are_checked_before_any_request(invoke):
    result = invoke("bench", "serve", "--percentile-metrics", "ttft,speed")
    assert result.exit_code == 1
    assert "unknown metric(s) speed" in result.stderr
