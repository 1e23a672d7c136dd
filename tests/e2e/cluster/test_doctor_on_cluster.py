"""`llmctl doctor -i` on a real two-host cluster: healthy, it passes and prints the Gloo
all-reduce between the nodes; broken (an interface variable naming a missing interface, a
VLLM_HOST_IP that is not the node's, a stopped worker container), it fails naming that node."""

from __future__ import annotations

import json

import pytest
import yaml
from test_launcher import IMAGE, llmctl


@pytest.fixture(scope="module")
def hosts(testbed, llmctl_image):
    return testbed.docker_hosts[:2]


def inventory(path, testbed, hosts, worker_env=None):
    nodes = [{"host": h.ip, "head": i == 0, "gpus": 1} for i, h in enumerate(hosts)]
    if worker_env:
        nodes[1]["env"] = worker_env
    doc = {
        "name": "doc",
        "image": IMAGE,
        "ssh": {"user": "root", "key": str(testbed.client_key)},
        "nodes": nodes,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def doctor(env, inv, *args, timeout: str = "60"):
    result = llmctl(env, "doctor", *args, "-i", str(inv), "--timeout", timeout, "--json",
                    check=False, timeout=900)  # fmt: skip
    return result.returncode, json.loads(result.stdout)


def failures(payload) -> list[dict]:
    return [c for c in payload["checks"] if c["status"] == "fail"]


@pytest.fixture(scope="module")
def healthy(cli_env, testbed, hosts, tmp_path_factory):
    inv = inventory(tmp_path_factory.mktemp("doc") / "doc.yaml", testbed, hosts)
    llmctl(cli_env, "cluster", "up", "-i", str(inv))
    yield inv
    llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)


def test_healthy_cluster_passes_with_gloo_numbers(cli_env, healthy, hosts):
    code, payload = doctor(cli_env, healthy)
    assert failures(payload) == [] and code == 0, json.dumps(payload)[-3000:]
    checks = {(c["check"], c["node"]) for c in payload["checks"]}
    for host in hosts:
        assert ("container", host.ip) in checks
    assert {c["check"] for c in payload["checks"]} >= {"host_ip", "ifname", "versions", "shm"}
    # Ray actors on each node see that node's own VLLM_HOST_IP and interface, not the head's.
    seen = {n["ray_ip"]: n for n in payload["nodes"]}
    assert sorted(seen) == sorted(h.ip for h in hosts)
    assert all(n["host_ip"] == ip and n["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
               for ip, n in seen.items())  # fmt: skip
    (gloo,) = payload["collectives"]
    assert gloo["backend"] == "gloo" and gloo["ok"] and len(set(gloo["nodes"])) == 2
    assert all(size["correct"] and size["busbw_gbps"] > 0 for size in gloo["sizes"])
    # The human table: the all-reduce between the two nodes, with its bandwidth.
    text = llmctl(cli_env, "doctor", "nccl", "-i", str(healthy)).stdout
    assert "gloo all-reduce, 2 rank(s)" in text and "GB/s" in text and "correct" in text
    assert "links from rank 0" in text


def test_stopped_worker_container_is_named(cli_env, healthy, hosts):
    worker = hosts[1]
    worker.docker(["stop", "--time", "2", "llmctl-doc"])
    try:
        code, payload = doctor(cli_env, healthy, timeout="20")
        assert code == 1
        (row,) = [c for c in failures(payload) if c["check"] == "container"]
        assert row["node"] == worker.ip and "exited" in row["detail"]
        assert "cluster up" in row["fix"]
    finally:
        worker.docker(["start", "llmctl-doc"])


def test_missing_interface_and_wrong_host_ip_name_the_worker(cli_env, testbed, hosts, tmp_path):
    # Last: it recreates the worker of the module's cluster (same name) with broken settings.
    worker = hosts[1]
    inv = inventory(
        tmp_path / "bad.yaml", testbed, hosts,
        worker_env={"GLOO_SOCKET_IFNAME": "eth9", "VLLM_HOST_IP": "10.77.0.50"},
    )  # fmt: skip
    try:
        llmctl(cli_env, "cluster", "up", "-i", str(inv))
        code, payload = doctor(cli_env, inv, timeout="20")
        assert code == 1
        bad = failures(payload)
        ifname = [c for c in bad if c["check"] == "ifname"]
        assert len(ifname) == 1 and worker.ip in ifname[0]["node"], bad
        assert "eth9" in ifname[0]["detail"] and ifname[0]["fix"]
        host_ip = [c for c in bad if c["check"] == "host_ip"]
        assert len(host_ip) == 1 and worker.ip in host_ip[0]["node"], bad
        assert "10.77.0.50" in host_ip[0]["detail"]
        # The all-reduce fails on both ranks; every other failure is the worker's alone.
        node_checks = [c for c in bad if not c["check"].startswith(("allreduce/", "link/"))]
        assert all(hosts[0].ip not in c["node"] for c in node_checks), bad
    finally:
        llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)
