"""`llmctl doctor` as a user runs it on this machine: the all-reduce across local ranks, the
checklist as a table or JSON, and typed errors (JSON too with --json)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def doctor(invoke):
    def run(*args: str, env: dict[str, str] | None = None):
        return invoke("doctor", *args, env={"COLUMNS": "200", **(env or {})})

    return run


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cli_nccl_json(doctor):
    result = doctor("nccl", "--backend", "gloo", "--world-size", "2", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is True
    (report,) = payload["collectives"]
    assert report["backend"] == "gloo" and report["correct"] is True
    assert len(report["links"]) == 1 and report["links"][0]["latency_us"] > 0


def test_cli_checklist_fails_on_a_missing_interface(doctor):
    env = {"GLOO_SOCKET_IFNAME": "nosuch0", "VLLM_HOST_IP": "127.0.0.1"}
    result = doctor("--no-allreduce", env=env)
    assert result.exit_code == 1
    out = result.stdout
    assert "llmctl doctor" in out and "ifname" in out and "fail" in out
    assert "GLOO_SOCKET_IFNAME=nosuch0 names nosuch0, missing" in out
    assert "1 fail" in out


def test_cli_checklist_json_with_the_all_reduce(doctor, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {"VLLM_HOST_IP": "127.0.0.1", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    result = doctor("check", "--backend", "gloo", "--model", str(model), "--json", env=env)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is True
    checks = {row["check"]: row for row in payload["checks"]}
    assert {"host_ip", "ifname", "env", "shm", "versions", "model", "allreduce/gloo"} <= set(checks)
    assert checks["host_ip"]["status"] == "pass"
    assert "sums correct" in checks["allreduce/gloo"]["detail"]
    assert payload["nodes"][0]["model_fingerprint"]


def test_cli_nccl_backend_without_cuda_is_one_error_line(doctor):
    if _cuda_devices() >= 2:
        pytest.skip("this machine has CUDA devices")
    result = doctor("nccl", "--backend", "nccl")
    assert result.exit_code == 1
    assert "error: the NCCL check needs 2 CUDA devices" in result.stderr
    assert "hint: use --backend gloo" in result.stderr


def test_cli_json_errors_stay_json(doctor):
    if _cuda_devices() >= 2:
        pytest.skip("this machine has CUDA devices")
    result = doctor("nccl", "--backend", "nccl", "--json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and "CUDA devices" in payload["error"]
    assert payload["hint"] == "use --backend gloo, or fewer ranks (--world-size)"


def test_cli_nccl_out_of_time_names_the_ranks_and_the_timeout(doctor):
    # No worker imports torch within 0.1 s: the check ends at its deadline, naming every rank.
    result = doctor("nccl", "--backend", "gloo", "--world-size", "2", "--timeout", "0.1")
    assert result.exit_code == 1
    assert "not started" in result.stdout
    assert "error: the gloo all-reduce check timed out after 0.1 s: all ranks 0, 1" in result.stderr
    assert "raise --timeout" in result.stderr


def test_cli_ray_check_without_a_cluster_here_says_how_to_name_one(doctor, tmp_path):
    # No RAY_ADDRESS, no `ray start` record: the check joins nothing (not a raylet merely seen
    # in the process table, such as a container's), and says so at once.
    env = {"RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": None}
    result = doctor("nccl", "--ray", "--backend", "gloo", env=env)
    assert result.exit_code == 1
    assert (
        "error: no Ray cluster here: RAY_ADDRESS is not set and no `ray start` ran on this "
        "machine" in result.stderr
    )
    assert "set RAY_ADDRESS=HEAD_IP:6379" in result.stderr


def test_cli_ray_check_names_a_stale_ray_start_record(doctor, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
    env = {"RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": None}
    result = doctor("nccl", "--ray", "--backend", "gloo", "--json", env=env)
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["error"].startswith(f"no Ray cluster answers at 127.0.0.1:{port}")
    assert "that cluster is gone" in payload["hint"]
