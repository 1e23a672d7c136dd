"""`llmctl serve -i cluster.yaml` through the CLI over a recording fake transport (the head
container's `docker exec` answered by pattern): the exact argv the head server runs, engine and
server options included. tests/e2e/cluster runs it for real (root, Docker, Ray)."""

from __future__ import annotations

import json

from fake_transport import FakeTransport

from llmctl.cluster.launch import launcher

INVENTORY = """\
name: demo
image: llmctl:latest
nodes:
  - {host: n1, ip: 10.0.0.1, head: true, gpus: 2}
  - {host: n2, ip: 10.0.0.2, gpus: 2}
"""


def test_serve_on_a_cluster_runs_the_derived_argv_in_the_head_container(
    invoke, monkeypatch, tmp_path
):
    head = FakeTransport("n1")
    head.reply(r"^docker exec --detach llmctl-demo ", "")
    head.reply(r"head_server probe 8011$", json.dumps({"running": True, "health": 200, "pid": 7}))
    fakes = {"n1": head, "n2": FakeTransport("n2")}
    monkeypatch.setattr(launcher, "ssh_transports", lambda inventory: fakes)
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)

    result = invoke(
        "serve", "-i", str(path), "/models/smol", "-tp", "2", "-pp", "2", "--port", "8011",
        "--dtype", "float32", "--gpu-memory-utilization", "0.8", "--shutdown-timeout", "5",
        env={"COLUMNS": "200"},
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    assert "serving /models/smol (tp=2, pp=2, pid 7) at http://10.0.0.1:8011" in result.stdout
    [launch] = head.ran(r"^docker exec --detach llmctl-demo ")
    served = launch[launch.index("llmctl") :]
    assert served == [
        "llmctl", "serve", "/models/smol", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--host", "0.0.0.0", "--port", "8011", "--shutdown-timeout", "5.0",
        "--dtype", "float32", "--gpu-memory-utilization", "0.8",
    ]  # fmt: skip
    record = json.loads(head.files["/root/.llmctl/demo-server.json"])
    assert record["argv"] == served


def test_serve_on_a_cluster_passes_the_supervision_flags(invoke, monkeypatch, tmp_path):
    head = FakeTransport("n1")
    head.reply(r"^docker exec --detach llmctl-demo ", "")
    head.reply(r"head_server probe 8011$", json.dumps({"running": True, "health": 200, "pid": 7}))
    monkeypatch.setattr(
        launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": FakeTransport("n2")}
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)

    result = invoke(
        "serve", "-i", str(path), "/models/smol", "--port", "8011", "--stall-timeout", "10",
        "--restart-on-failure", "--max-restarts", "5", env={"COLUMNS": "200"},
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    [launch] = head.ran(r"^docker exec --detach llmctl-demo ")
    served = " ".join(launch[launch.index("llmctl") :])
    assert "--stall-timeout 10.0 --restart-on-failure --max-restarts 5" in served
