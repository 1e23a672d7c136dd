"""`llmctl doctor -i`: the command run in the head container (its rows join the container rows;
tests/e2e/cluster/test_doctor_on_cluster.py runs it for real)."""

from __future__ import annotations

import pytest

from llmctl.cluster.doctor.cluster_doctor import ClusterDoctorRun, _json_object, doctor_argv
from llmctl.cluster.doctor.doctor_checks import CheckResult


def test_the_head_runs_the_checks_on_ray_as_json():
    argv = doctor_argv("llmctl-demo", nccl=False, model="/m", backend="gloo", timeout=20,
                       nvlink=False)  # fmt: skip
    assert argv[:3] == ["docker", "exec", "llmctl-demo"]
    assert argv[3:9] == ["env", "COLUMNS=160", "llmctl", "doctor", "check", "--json"]
    assert argv[9:] == ["--ray", "--backend", "gloo", "--timeout", "20", "--model", "/m", "--pcie"]
    nccl = doctor_argv("c", nccl=True, model="/m", backend="auto", timeout=7.5)
    assert nccl[6:] == ["doctor", "nccl", "--ray", "--backend", "auto", "--timeout", "7.5"]


def test_one_failed_row_fails_the_run():
    ok = CheckResult("container", "10.0.0.1", "pass", "running")
    warn = CheckResult("shm", "10.0.0.1", "warn", "small")
    assert ClusterDoctorRun([ok, warn]).ok
    assert not ClusterDoctorRun([ok, CheckResult("container", "10.0.0.2", "fail", "exited")]).ok
    assert not ClusterDoctorRun([ok], {"ok": False}).ok


def test_the_heads_json_is_found_among_ray_output():
    noisy = "(RayRank pid=7, ip=10.0.0.2) Traceback ...\n"
    noisy += '{\n  "ok": false,\n  "checks": []\n}\n(x) bye\n'
    assert _json_object(noisy) == {"ok": False, "checks": []}
    assert _json_object('{"ok": true}') == {"ok": True}
    with pytest.raises(ValueError):
        _json_object("error: no Ray cluster\n")
