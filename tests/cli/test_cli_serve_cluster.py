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
    head.reply(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ", "")
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
    [launch] = head.ran(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ")
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
    head.reply(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ", "")
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
    [launch] = head.ran(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ")
    served = " ".join(launch[launch.index("llmctl") :])
    assert "--stall-timeout 10.0 --restart-on-failure --max-restarts 5" in served


def test_serve_on_a_cluster_makes_an_api_key_on_no_command_line(invoke, monkeypatch, tmp_path):
    """serve -i makes a key, keeps it in a 0600 env file on the head node and hands it to the
    server with `docker exec --env-file`; the next serve -i reuses it; --no-api-key makes none;
    a key in the inventory's env stays the one used."""
    head = FakeTransport("n1")
    head.reply(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ", "")
    head.reply(r"head_server probe 8011$", json.dumps({"running": True, "health": 200, "pid": 7}))
    head.reply(r"head_server stop$", "")  # each serve -i below stops the one before
    monkeypatch.setattr(
        launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": FakeTransport("n2")}
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)
    serve = ("serve", "-i", str(path), "/models/smol", "--port", "8011")

    result = invoke(*serve, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    key_file = "/root/.llmctl/demo-api.env"
    assert ["(write)", key_file, "0o600"] in head.calls
    key = head.files[key_file].decode().strip().removeprefix("LLMCTL_API_KEY=")
    assert len(key) >= 32
    [launch] = head.ran(r"^docker exec --detach --env-file ")
    assert launch[3:6] == ["--env-file", key_file, "llmctl-demo"]
    assert all(key not in " ".join(argv) for argv in head.calls)
    assert f"API key: LLMCTL_API_KEY in n1:{key_file} (mode 0600" in result.stdout
    assert json.loads(head.files["/root/.llmctl/demo-server.json"])["api_key_file"] == key_file

    head.calls.clear()
    again = invoke(*serve, "--max-num-seqs", "8")  # another server, the same key
    assert again.exit_code == 0, again.output
    assert not [call for call in head.calls if call[:2] == ["(write)", key_file]]
    assert head.files[key_file].decode().strip() == f"LLMCTL_API_KEY={key}"

    head.calls.clear()
    result = invoke(*serve, "--no-api-key", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not head.ran(r"--env-file") and head.ran(r"^docker exec --detach llmctl-demo ")
    assert "API key: none (--no-api-key)" in result.stdout

    path.write_text(INVENTORY.replace("image:", "env: {LLMCTL_API_KEY: from-inventory}\nimage:"))
    head.calls.clear()
    result = invoke(*serve, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not head.ran(r"--env-file")
    assert f"API key: LLMCTL_API_KEY from {path}'s env" in result.stdout


def mp_node(name: str, probe: dict) -> FakeTransport:
    """A node whose container `cluster up --backend mp` started, answering the server probe."""
    inspect = [{"Name": "/llmctl-demo", "State": {"Status": "running", "Running": True},
                "Config": {"Labels": {"llmctl.backend": "mp"}}}]  # fmt: skip
    fake = FakeTransport(name)
    fake.reply(r"^docker container inspect llmctl-demo$", json.dumps(inspect))
    fake.reply(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ", "")
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
    [on_head] = head.ran(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ")
    [on_worker] = worker.ran(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ")
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
        [launch] = fake.ran(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ")
        served = " ".join(launch[launch.index("llmctl") :])
        assert f"--node-rank {rank}" in served  # a headless node rejoins after a failure too
        assert "--stall-timeout 10.0 --restart-on-failure" in served
    # Node ranks come from the inventory (which lists a node once): none can be given twice.
    refused = invoke("serve", "-i", str(path), "/m", "--node-rank", "1", env={"COLUMNS": "200"})
    assert refused.exit_code == 1
    assert "--node-rank: with -i, every node's place in the group comes from the" in (
        refused.output
    )


def test_status_says_whether_the_group_is_authenticated_and_where_the_api_key_is(
    invoke, monkeypatch, tmp_path
):
    head = mp_node("n1", {"running": True, "health": 200, "pid": 7})
    worker = mp_node("n2", {"running": True, "health": None, "pid": 9})
    versions = json.dumps({"python": "3.11.2", "torch": "2.13.0", "ray": None, "llmctl": "0.1"})
    for fake in (head, worker):
        fake.reply(r"^docker exec llmctl-demo python3 -c ", versions)
        fake.reply(r"head_server stop$", "")
    monkeypatch.setattr(launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": worker})
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)
    worker_env = "/root/.llmctl/demo-10.0.0.2.env"
    for fake, env_file in ((head, "/root/.llmctl/demo-10.0.0.1.env"), (worker, worker_env)):
        # what `cluster up` wrote
        fake.files[env_file] = b"VLLM_HOST_IP=x\nLLMCTL_CLUSTER_SECRET=" + b"s" * 64 + b"\n"
    serve = ("serve", "-i", str(path), "/models/smol", "--port", "8011", "--backend", "mp")
    assert invoke(*serve).exit_code == 0

    def status() -> str:
        result = invoke("cluster", "status", "-i", str(path), env={"COLUMNS": "250"})
        assert result.exit_code == 0, result.output
        return result.stdout

    out = status()
    assert "Joins: authenticated: the 2 nodes share one cluster secret (LLMCTL_CLUSTER_SECRET " \
        "in each node's 0600 env file)" in out  # fmt: skip
    assert "API key: LLMCTL_API_KEY in n1:/root/.llmctl/demo-api.env (mode 0600" in out
    assert "s" * 64 not in out
    worker.files[worker_env] = b"LLMCTL_CLUSTER_SECRET=" + b"t" * 64 + b"\n"
    assert "Joins: not authenticated: the nodes hold different cluster secrets" in status()
    worker.files[worker_env] = b"VLLM_HOST_IP=x\n"
    assert "Joins: not authenticated: no cluster secret on n2 (run `llmctl cluster up" in status()
    assert invoke(*serve, "--insecure-join", "--no-api-key").exit_code == 0
    out = status()
    assert "Joins: not authenticated: the server runs with --insecure-join" in out
    assert "API key: none (--no-api-key)" in out


# The head's ~/.llmctl outlives the llmctl that wrote it (the test bed's hosts share /root).
RECORD = "/root/.llmctl/demo-server.json"
OLD_ARGV = ["llmctl", "serve", "/models/old", "--port", "8011"]


def test_serve_replaces_a_server_whose_record_another_version_wrote(invoke, monkeypatch, tmp_path):
    """A record with a field this llmctl does not know is read (serve -i names the server it
    replaces); one lacking a field it needs is no record, and serve -i stops the server it
    described, says so, and starts its own (it crashed with a TypeError)."""
    head = FakeTransport("n1")
    head.reply(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ", "")
    head.reply(r"head_server probe 8011$", json.dumps({"running": True, "health": 200, "pid": 7}))
    head.reply(r"head_server stop$", "")
    monkeypatch.setattr(
        launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": FakeTransport("n2")}
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)
    serve = ("serve", "-i", str(path), "/models/smol", "--port", "8011", "--no-api-key")
    newer = {
        "model": "/models/old", "port": 8011, "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "argv": OLD_ARGV, "backend": "ray", "workers": [],
        "api_key_file": None, "served_by": "a later llmctl",
    }  # fmt: skip
    head.files[RECORD] = json.dumps(newer).encode()

    result = invoke(*serve, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"stopping the server started with {' '.join(OLD_ARGV)}" in result.output
    assert len(head.ran(r"head_server stop$")) == 1

    older = {k: v for k, v in newer.items() if k not in ("pipeline_parallel_size", "served_by")}
    for stale in (json.dumps(older).encode(), b"{not json"):
        head.files[RECORD] = stale
        head.calls.clear()
        result = invoke(*serve, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        said = " ".join(result.output.split())
        assert f"stopped the running server: its record {RECORD} is not one this llmctl" in said
        assert len(head.ran(r"head_server stop$")) == 1
        assert head.ran(r"^docker exec --detach llmctl-demo .* /models/smol ")
        assert json.loads(head.files[RECORD])["model"] == "/models/smol"  # this version's


def test_status_and_serve_on_an_mp_cluster_with_an_unreadable_record(invoke, monkeypatch, tmp_path):
    """`cluster status` says the record cannot be read and what replaces the server; serve -i
    stops the old group's process on every node (its workers are not known) before its own."""
    head = mp_node("n1", {"running": True, "health": 200, "pid": 7})
    worker = mp_node("n2", {"running": True, "health": None, "pid": 9})
    versions = json.dumps({"python": "3.11.2", "torch": "2.13.0", "ray": None, "llmctl": "0.1"})
    for fake in (head, worker):
        fake.reply(r"^docker exec llmctl-demo python3 -c ", versions)
        fake.reply(r"head_server stop$", "")
    monkeypatch.setattr(launcher, "ssh_transports", lambda inventory: {"n1": head, "n2": worker})
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)
    head.files[RECORD] = json.dumps({"model": "/models/old", "argv": OLD_ARGV}).encode()

    status = invoke("cluster", "status", "-i", str(path), env={"COLUMNS": "250"})
    assert status.exit_code == 0, status.output
    assert (
        f"Server: unknown: the record n1:{RECORD} is not one this llmctl reads (another "
        f"version's?); `llmctl serve -i {path}` stops that server and starts its own"
    ) in " ".join(status.stdout.split())

    serve = ("serve", "-i", str(path), "/models/smol", "--port", "8011", "--backend", "mp")
    result = invoke(*serve, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"its record {RECORD} is not one this llmctl reads" in " ".join(result.output.split())
    for fake in (head, worker):
        stop = fake.ran(r"head_server stop$")
        launch = fake.ran(r"^docker exec --detach (--env-file \S+ )?llmctl-demo ")
        assert len(stop) == 1 and fake.calls.index(stop[0]) < fake.calls.index(launch[0])
    status = invoke("cluster", "status", "-i", str(path), env={"COLUMNS": "250"})
    assert "Server: /models/smol (tp=2, pp=2, mp on 2 nodes)" in status.stdout
    assert "is not one this llmctl reads" not in status.stdout
