"""`llmctl doctor -i`: the command run in the head container (its rows join the container rows;
tests/e2e/cluster/test_doctor_on_cluster.py runs it for real)."""

from __future__ import annotations

import json

import pytest

from llmctl.cluster.doctor.cluster_doctor import ClusterDoctorRun, _json_object, doctor_argv
from llmctl.cluster.doctor.collective_report import CollectiveReport, LinkResult, SizeResult
from llmctl.cluster.doctor.doctor_checks import CheckResult
from llmctl.cluster.doctor.mp_doctor import DOCTOR_PORT, collective_reports, group_argvs


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


def test_on_an_mp_cluster_each_rank_joins_the_heads_rendezvous():
    head, worker = group_argvs("llmctl-demo", head_ip="10.0.0.1", nnodes=2, backend="gloo",
                               timeout=30, json_out=True)  # fmt: skip
    where = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", str(DOCTOR_PORT)]
    assert head == ["docker", "exec", "llmctl-demo", "env", "COLUMNS=160", "llmctl", "doctor",
                    "nccl", "--json", "--backend", "gloo", "--world-size", "2", *where,
                    "--timeout", "30"]  # fmt: skip
    assert worker[:4] == ["docker", "exec", "--detach", "llmctl-demo"]
    assert worker[worker.index("llmctl") :] == [
        "llmctl", "serve", "--headless", "-pp", "2", *where, "--node-rank", "1",
        "--rendezvous-timeout", "30",
    ]  # fmt: skip
    assert DOCTOR_PORT != 29501  # beside a serving group on the default port


def test_the_all_reduce_report_survives_json_and_is_named_by_node():
    report = CollectiveReport(
        "gloo", 2, ("llm-n1", "node 1"),
        sizes=(SizeResult(4, 50, 120.0, 0.0, 0.0),),
        links=(LinkResult(0, 1, 80.0, 1.5, "llm-n1", "node 1"),),
    )  # fmt: skip
    assert CollectiveReport.from_json(report.to_json()) == report
    text = "INFO joining\n" + json.dumps({"ok": True, "collectives": [report.to_json()]})
    [named] = collective_reports(text, ["llm-n1", "llm-n2"])
    assert named.nodes == ("llm-n1", "llm-n2") and named.ok
    assert collective_reports("error: no such option\n", ["a", "b"]) is None


def test_doctor_on_an_mp_cluster_checks_every_nodes_facts_and_the_all_reduce(monkeypatch):
    from fake_transport import FakeTransport

    from llmctl.cluster.doctor.cluster_doctor import run_doctor
    from llmctl.cluster.doctor.node_facts import NodeReport
    from llmctl.cluster.inventory import parse_inventory
    from llmctl.cluster.launch.launcher import Cluster

    inventory = parse_inventory(
        "name: demo\nimage: i\nnodes:\n  - {host: n1, ip: 10.0.0.1, head: true, gpus: 1}\n"
        "  - {host: n2, ip: 10.0.0.2, gpus: 1}\n"
    )
    state = [{"Name": "/llmctl-demo", "State": {"Status": "running", "Running": True},
              "Config": {"Labels": {"llmctl.backend": "mp"}}}]  # fmt: skip
    versions = {"python": "3.11.2", "torch": "2.13.0", "ray": None, "llmctl": "0.1"}
    fakes = {}
    for host, ip in (("n1", "10.0.0.1"), ("n2", "10.0.0.2")):
        fake = FakeTransport(host)
        fake.reply(r"^docker container inspect llmctl-demo$", json.dumps(state))
        facts = NodeReport(f"llm-{host}", ip, env={"VLLM_HOST_IP": ip}, versions=versions,
                           shm_bytes=2**34)  # fmt: skip
        fake.reply(r"doctor check --json --no-allreduce$",
                   json.dumps({"ok": True, "nodes": [facts.to_json()]}))  # fmt: skip
        fake.reply(r"^docker exec --detach llmctl-demo ", "")
        fakes[host] = fake
    sums = CollectiveReport("gloo", 2, ("llm-n1", "node 1"),
                            sizes=(SizeResult(4, 50, 120.0, 0.0, 0.0),))  # fmt: skip
    fakes["n1"].reply(r"doctor nccl --json", json.dumps({"collectives": [sums.to_json()]}))

    run = run_doctor(Cluster(inventory, fakes), backend="gloo", timeout=30)

    assert not fakes["n1"].ran("--ray")  # no Ray anywhere
    assert fakes["n2"].ran(r"serve --headless -pp 2 --nnodes 2 --master-addr 10.0.0.1")
    rows = {(r.check, r.node): r for r in run.results}
    assert rows["allreduce/gloo", "llm-n1"].status == "pass"
    assert "2 rank(s), sums correct" in rows["allreduce/gloo", "llm-n1"].detail
    assert {node for check, node in rows if check == "versions"} <= {"llm-n1", "llm-n2"}
    assert [r.node for r in run.results if r.check == "container"] == ["n1", "n2"]

    fakes["n1"].reply(r"doctor nccl --json", (1, "", "error: node 1 did not join within 30 s"))
    failed = run_doctor(Cluster(inventory, fakes), backend="gloo", timeout=30)
    assert not failed.ok
    [row] = [r for r in failed.results if r.check == "allreduce"]
    assert row.detail == "the all-reduce did not report: error: node 1 did not join within 30 s"
