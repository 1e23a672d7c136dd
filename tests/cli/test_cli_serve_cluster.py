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


def mp_node(name: str, probe: dict) -> FakeTransport:
    """A node whose container `cluster up --backend mp` started, answering the server probe."""
    inspect = [{"Name": "/llmctl-demo", "State": {"Status": "running", "Running": True},
                "Config": {"Labels": {"llmctl.backend": "mp"}}}]  # fmt: skip
    fake = FakeTransport(name)
    fake.reply(r"^docker container inspect llmctl-demo$", json.dumps(inspect))
    fake.reply(r"^docker exec --detach llmctl-demo ", "")
    fake.reply(r"head_server probe 8011$", json.dumps(probe))
    return fake


def test_serve_on_an_mp_cluster_starts_every_nodes_part_of_the_group(invoke, monkeypatch, tmp_path):
    head = mp_node("n1", {"running": True, "health": 200, "pid": 7})
    worker = mp_node("n2", {"running": True, "health": None, "pid": 9})
    monkeypatch.setattr(launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": worker})
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)

    result = invoke(
        "serve", "-i", str(path), "/models/smol", "--port", "8011", "--backend", "mp",
        "--dtype", "float32", env={"COLUMNS": "200"},
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    assert "serving /models/smol (tp=2, pp=2, pid 7) at http://10.0.0.1:8011" in result.stdout
    [on_head] = head.ran(r"^docker exec --detach llmctl-demo ")
    [on_worker] = worker.ran(r"^docker exec --detach llmctl-demo ")
    common = [
        "llmctl", "serve", "/models/smol", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp",
        "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29501",
    ]  # fmt: skip
    assert on_head[on_head.index("llmctl") :] == common + [
        "--node-rank", "0", "--host", "0.0.0.0", "--port", "8011", "--dtype", "float32",
    ]  # fmt: skip
    assert on_worker[on_worker.index("llmctl") :] == common + [
        "--node-rank", "1", "--headless", "--dtype", "float32",
    ]  # fmt: skip
    record = json.loads(head.files["/root/.llmctl/demo-server.json"])
    assert record["backend"] == "mp" and record["workers"] == [
        ["n2", on_worker[on_worker.index("llmctl") :]]
    ]

    # The containers run the mp backend: `status` shows each node's process, no Ray.
    versions = json.dumps({"python": "3.11.2", "torch": "2.13.0", "ray": None, "llmctl": "0.1"})
    for fake in (head, worker):
        fake.reply(r"^docker exec llmctl-demo python3 -c ", versions)
    status = invoke("cluster", "status", "-i", str(path), env={"COLUMNS": "200"})
    assert status.exit_code == 0, status.output
    assert not head.ran(r"ray (status|list)")
    assert (
        "Server: /models/smol (tp=2, pp=2, mp on 2 nodes) at http://10.0.0.1:8011/v1:"
        " healthy" in status.stdout
    )
    row = next(line for line in status.stdout.splitlines() if "10.0.0.2" in line)
    assert "running" in row and "pid 9" in row

    # A Ray-backend serve on these containers is refused, naming the fix.
    refused = invoke("serve", "-i", str(path), "--backend", "ray", env={"COLUMNS": "200"})
    assert refused.exit_code == 1
    assert "the cluster's containers were started for the mp backend, not ray" in refused.output


def test_serve_on_an_mp_cluster_supervises_every_node_and_assigns_their_ranks(
    invoke, monkeypatch, tmp_path
):
    head = mp_node("n1", {"running": True, "health": 200, "pid": 7})
    worker = mp_node("n2", {"running": True, "health": None, "pid": 9})
    monkeypatch.setattr(launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": worker})
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)

    result = invoke(
        "serve", "-i", str(path), "/models/smol", "--port", "8011", "--restart-on-failure",
        "--stall-timeout", "10", env={"COLUMNS": "200"},
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    for fake, rank in ((head, "0"), (worker, "1")):
        [launch] = fake.ran(r"^docker exec --detach llmctl-demo ")
        served = " ".join(launch[launch.index("llmctl") :])
        assert f"--node-rank {rank}" in served  # a headless node rejoins after a failure too
        assert "--stall-timeout 10.0 --restart-on-failure" in served
    # Node ranks come from the inventory (which lists a node once): none can be given twice.
    refused = invoke("serve", "-i", str(path), "/m", "--node-rank", "1", env={"COLUMNS": "200"})
    assert refused.exit_code == 1
    assert "--node-rank: with -i, every node's place in the group comes from the" in (
        refused.output
    )
