"""`llmctl cluster` and run_cluster.sh on real hosts: network namespaces with their own sshd and
Docker daemon (testbed.py), the llmctl image built by `llmctl image build`, a real Ray cluster.

Driven only through the `llmctl` command and run_cluster.sh, as a user would; the test bed's own
access (nsenter) is used only to look at the hosts and to break them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import default_signals

ROOT = Path(__file__).resolve().parents[3]
LLMCTL = str(Path(sys.executable).parent / "llmctl")
IMAGE = "llmctl:e2e"
MODEL = "/srv/llmctl/models/tiny"
CONTAINER = "llmctl-e2e"


@pytest.fixture(scope="module")
def cluster_hosts(testbed, llmctl_image):
    """Hosts 1-3 with the image loaded and a small model at the same path on each."""
    hosts = testbed.docker_hosts[:3]
    for host in hosts:
        write_model(host)
    return hosts


def write_model(host) -> None:
    model = host.srv_dir / "models" / "tiny"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\0" * 4096)


def llmctl(env, *args: str, check: bool = True, timeout: float = 600):
    result = subprocess.run(
        [LLMCTL, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"llmctl {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def write_inventory(path: Path, testbed, nodes: list[dict], name: str = "e2e", **top) -> Path:
    doc = {
        "name": name,
        "image": IMAGE,
        "model": MODEL,
        "ssh": {"user": "root", "key": str(testbed.client_key)},
        "env": {"LLMCTL_E2E": "1"},
        **top,
        "nodes": nodes,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def three_nodes(hosts, gpus: int = 2) -> list[dict]:
    return [{"host": h.ip, "head": i == 0, "gpus": gpus} for i, h in enumerate(hosts)]


def container_id(host, name: str = CONTAINER) -> str | None:
    result = host.docker(["container", "inspect", "--format", "{{.Id}}", name], check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def container_env(host, name: str = CONTAINER) -> dict[str, str]:
    out = host.docker(["exec", name, "env"]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def ray_status(host, name: str = CONTAINER) -> str:
    return host.docker(["exec", name, "ray", "status"]).stdout


# -- the healthy path: up, up again, status, exec, logs, change, down ----------------------------
@pytest.fixture(scope="class")
def inventory(tmp_path_factory, testbed, cluster_hosts):
    path = tmp_path_factory.mktemp("inv") / "cluster.yaml"
    return write_inventory(path, testbed, three_nodes(cluster_hosts))


class TestClusterUp:
    def test_up_forms_the_ray_cluster(self, cli_env, inventory, cluster_hosts):
        result = llmctl(cli_env, "cluster", "up", "-i", str(inventory))
        out = result.stdout
        assert out.count("created") == 3, out
        assert "cluster e2e is up: 3 Ray nodes, 6 GPUs" in out
        head = cluster_hosts[0]
        status = ray_status(head)
        assert len(re.findall(r"^\s*1 node_", status, re.M)) == 3, status
        assert re.search(r"0\.0/6\.0 GPU", status), status
        for host in cluster_hosts:
            env = container_env(host)
            assert env["VLLM_HOST_IP"] == host.ip
            assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
            assert env["LLMCTL_E2E"] == "1"
            assert env["RAY_AUTH_MODE"] == "token" and len(env["RAY_AUTH_TOKEN"]) == 64
            # The token travels in a 0600 env file, not on the command line.
            assert (
                env["RAY_AUTH_TOKEN"]
                not in host.docker(["inspect", "--format", "{{json .Args}}", CONTAINER]).stdout
            )
            mode = host.run(["stat", "-c", "%a", f"/root/.llmctl/e2e-{host.ip}.env"]).stdout.strip()
            assert mode == "600"
        # One cluster secret, which the nodes prove when they join, in every container's env
        # (through the same env file), on no command line.
        secrets = {container_env(host)["LLMCTL_CLUSTER_SECRET"] for host in cluster_hosts}
        (secret,) = secrets
        assert len(secret) == 64
        for host in cluster_hosts:
            args = host.docker(["inspect", "--format", "{{json .Args}}", CONTAINER]).stdout
            assert secret not in args
        # The captured text the unit tests parse.
        data = ROOT / "tests" / "unit" / "data" / "ray_status_3nodes.txt"
        if not data.exists():
            data.write_text(status)

    def test_second_up_changes_nothing(self, cli_env, inventory, cluster_hosts):
        before = [container_id(h) for h in cluster_hosts]
        out = llmctl(cli_env, "cluster", "up", "-i", str(inventory)).stdout
        assert "nothing changed" in out and out.count("unchanged") == 3, out
        assert [container_id(h) for h in cluster_hosts] == before

    def test_status_exec_logs(self, cli_env, inventory, cluster_hosts):
        out = llmctl(cli_env, "cluster", "status", "-i", str(inventory)).stdout
        rows = [line for line in out.splitlines() if "10.77.0.1" in line]
        assert len(rows) == 3 and all("running" in r and "alive" in r for r in rows), out
        assert all("2.13.0" in r for r in rows)  # torch's version, read in each container
        assert "Ray: 3 nodes, 6 GPUs" in out
        worker = cluster_hosts[1]
        result = llmctl(cli_env, "cluster", "exec", worker.ip, "-i", str(inventory), "--",
                        "printenv", "VLLM_HOST_IP")  # fmt: skip
        assert result.stdout.strip() == worker.ip
        failed = llmctl(cli_env, "cluster", "exec", "head", "-i", str(inventory), "--", "false",
                        check=False)  # fmt: skip
        assert failed.returncode == 1
        logs = llmctl(cli_env, "cluster", "logs", "head", "-i", str(inventory)).stdout
        assert "Ray runtime started" in logs

    def test_dry_run_prints_commands_and_changes_nothing(
        self, cli_env, inventory, cluster_hosts, tmp_path
    ):
        doc = yaml.safe_load(inventory.read_text())
        doc["nodes"][2]["env"] = {"NCCL_DEBUG": "INFO"}
        changed = tmp_path / "changed.yaml"
        changed.write_text(yaml.safe_dump(doc))
        before = [container_id(h) for h in cluster_hosts]
        out = llmctl(cli_env, "cluster", "up", "-i", str(changed), "--dry-run").stdout
        third = cluster_hosts[2].ip
        assert f"docker rm --force {CONTAINER}" in out
        assert f"docker run --detach --name {CONTAINER} --network host" in out
        assert "NCCL_DEBUG=INFO" in out and "RAY_AUTH_TOKEN=***" in out
        assert re.search(rf"{re.escape(third)}.*would recreate", out), out
        assert [container_id(h) for h in cluster_hosts] == before
        # Applied: only that node is recreated; the head and the other worker stay.
        out = llmctl(cli_env, "cluster", "up", "-i", str(changed)).stdout
        assert out.count("unchanged") == 2 and "recreated" in out, out
        after = [container_id(h) for h in cluster_hosts]
        assert after[:2] == before[:2] and after[2] != before[2]
        assert container_env(cluster_hosts[2])["NCCL_DEBUG"] == "INFO"
        assert "3 Ray nodes, 6 GPUs" in out

    def test_down_removes_every_container(self, cli_env, inventory, cluster_hosts):
        out = llmctl(cli_env, "cluster", "down", "-i", str(inventory)).stdout
        assert out.count("removed") == 3, out
        for host in cluster_hosts:
            listed = host.docker(["ps", "--all", "--quiet"]).stdout.strip()
            assert listed == "", f"{host.name} still has containers: {listed}"
        again = llmctl(cli_env, "cluster", "down", "-i", str(inventory)).stdout
        assert again.count("absent") == 3


# -- faults: each named, nothing started ------------------------------------------------------
def assert_fails(env, inventory: Path, *patterns: str, hosts=(), extra=()) -> str:
    result = llmctl(env, "cluster", "up", "-i", str(inventory), *extra, check=False)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text
    for pattern in patterns:
        assert re.search(pattern, text), f"{pattern!r} not in:\n{text}"
    for host in hosts:
        assert container_id(host, "llmctl-fault") is None, f"{host.name} has a container"
    return text


class TestFaults:
    @pytest.fixture
    def inv(self, tmp_path, testbed, cluster_hosts):
        def make(nodes=None, **top):
            nodes = nodes or three_nodes(cluster_hosts)
            return write_inventory(tmp_path / "f.yaml", testbed, nodes, name="fault", **top)

        return make

    def test_unreachable_host(self, cli_env, inv, cluster_hosts):
        nodes = three_nodes(cluster_hosts)
        nodes[2]["host"] = "10.77.0.99"
        text = assert_fails(
            cli_env, inv(nodes), r"cannot reach root@10\.77\.0\.99:22", r"nothing was started",
            hosts=cluster_hosts,
        )  # fmt: skip
        assert "Traceback" not in text

    def test_wrong_ssh_key(self, cli_env, inv, cluster_hosts, tmp_path):
        key = tmp_path / "other_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        assert_fails(
            cli_env, inv(ssh={"user": "root", "key": str(key)}),
            rf"root@{cluster_hosts[0].ip}:22 rejected the SSH key {key}", r"ssh\.key",
            hosts=cluster_hosts,
        )  # fmt: skip

    def test_host_without_docker(self, cli_env, inv, cluster_hosts, testbed):
        no_docker = testbed.hosts[3]
        nodes = three_nodes(cluster_hosts[:2]) + [{"host": no_docker.ip, "gpus": 2}]
        assert_fails(
            cli_env, inv(nodes), rf"{no_docker.ip}: the Docker daemon does not answer",
            r"start its daemon", hosts=cluster_hosts[:2],
        )  # fmt: skip

    def test_image_missing_on_a_node(self, cli_env, inv, cluster_hosts):
        host = cluster_hosts[2]
        host.docker(["tag", IMAGE, "llmctl:e2e-kept"])
        host.docker(["rmi", IMAGE])  # only the name goes; the kept tag holds the layers
        try:
            assert_fails(
                cli_env, inv(), rf"{host.ip}: the image {IMAGE} is not there", r"--image-file",
                hosts=cluster_hosts,
            )  # fmt: skip
        finally:
            host.docker(["tag", "llmctl:e2e-kept", IMAGE])
            host.docker(["rmi", "llmctl:e2e-kept"])

    def test_model_missing_on_a_worker(self, cli_env, inv, cluster_hosts, tmp_path):
        host = cluster_hosts[2]
        model = host.srv_dir / "models" / "tiny"
        model.rename(tmp_path / "moved")
        try:
            assert_fails(
                cli_env, inv(), rf"{host.ip}: the model {MODEL} is missing", r"--sync-model",
                hosts=cluster_hosts,
            )  # fmt: skip
        finally:
            (tmp_path / "moved").rename(model)

    def test_worker_ip_not_on_the_heads_network(self, cli_env, inv, cluster_hosts):
        host = cluster_hosts[2]
        host.add_address("10.88.0.13/24")
        try:
            nodes = three_nodes(cluster_hosts)
            nodes[2]["ip"] = "10.88.0.13"
            assert_fails(
                cli_env, inv(nodes),
                rf"{host.ip}: its IP 10\.88\.0\.13 is not on the head's network 10\.77\.0\.0/24",
                hosts=cluster_hosts,
            )  # fmt: skip
        finally:
            host.remove_address("10.88.0.13/24")

    def test_several_faults_are_reported_together(self, cli_env, inv, cluster_hosts, testbed):
        nodes = three_nodes(cluster_hosts[:2]) + [
            {"host": testbed.hosts[3].ip, "gpus": 2},
            {"host": "10.77.0.98", "gpus": 2},
        ]
        assert_fails(
            cli_env, inv(nodes), r"3 problems, nothing was started", r"10\.77\.0\.14: the Docker",
            r"cannot reach root@10\.77\.0\.98", rf"10\.77\.0\.14: the model {MODEL} is missing",
            hosts=cluster_hosts[:2],
        )  # fmt: skip


def test_image_file_and_sync_model_fill_a_bare_node(cli_env, testbed, cluster_hosts, tmp_path):
    """A node without the image and the model: --image-file loads one, --sync-model copies the
    other from the head, and the cluster comes up. The node's daemon keeps the image's layers
    under another name (as after an upgrade, when only llmctl's layer changed): the launcher
    uploads the file's manifest and config without the 3 GB of layers, and `docker load` finds
    them there."""
    bare = cluster_hosts[2]
    saved = testbed.image_file(IMAGE)
    bare.docker(["tag", IMAGE, "llmctl:e2e-kept"])
    bare.docker(["rmi", IMAGE])  # only the name goes
    model = bare.srv_dir / "models" / "tiny"
    for f in model.iterdir():
        f.unlink()
    model.rmdir()
    inventory = write_inventory(tmp_path / "c.yaml", testbed, three_nodes(cluster_hosts, gpus=1))
    try:
        out = llmctl(cli_env, "cluster", "up", "-i", str(inventory), "--image-file", str(saved),
                     "--sync-model").stdout  # fmt: skip
        assert f"{bare.ip}: the manifest only" in out and "copied the model" in out, out
        assert "the node held all 5 layers" in out, out
        assert "3 Ray nodes, 3 GPUs" in out
        assert (model / "config.json").read_text() == (
            cluster_hosts[0].srv_dir / "models" / "tiny" / "config.json"
        ).read_text()
    finally:
        llmctl(cli_env, "cluster", "down", "-i", str(inventory))
        testbed.load_image(IMAGE)
        bare.docker(["rmi", "llmctl:e2e-kept"], check=False)


# -- run_cluster.sh and cluster up --head/--worker: one node at a time -------------------------
def spawn_on(host, argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "DOCKER_HOST": host.docker_host}
    with log.open("wb") as out:
        return subprocess.Popen(
            [*host.nsenter(), *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=default_signals,  # SIGHUP reaches the script
        )  # fmt: skip


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)


def active_nodes(host, name: str) -> int:
    result = host.docker(["exec", name, "ray", "status"], check=False)
    return len(re.findall(r"^\s*1 node_", result.stdout, re.M)) if result.returncode == 0 else 0


def test_run_cluster_sh_as_the_seeds_use_it(cluster_hosts, tmp_path):
    head, worker = cluster_hosts[0], cluster_hosts[1]
    script = str(ROOT / "run_cluster.sh")
    procs = []
    try:
        gpus = ["-e", "LLMCTL_NUM_GPUS=1"]
        head_argv = ["bash", script, IMAGE, head.ip, "--head", "/tmp/hf"]
        head_argv += ["-e", f"VLLM_HOST_IP={head.ip}", *gpus]
        procs.append(spawn_on(head, head_argv, tmp_path / "head.log"))
        wait_until(lambda: active_nodes(head, "node") == 1, 90, "the head's Ray")
        worker_argv = ["bash", script, IMAGE, head.ip, "--worker", "/tmp/hf"]
        worker_argv += ["-e", f"VLLM_HOST_IP={worker.ip}", *gpus]
        procs.append(spawn_on(worker, worker_argv, tmp_path / "worker.log"))
        wait_until(lambda: active_nodes(head, "node") == 2, 90, "the worker to join")
        assert re.search(r"0\.0/2\.0 GPU", ray_status(head, "node"))
        assert container_env(worker, "node")["VLLM_HOST_IP"] == worker.ip
        # Stopping the head's script (a closed shell) removes its container.
        os.killpg(procs[0].pid, signal.SIGHUP)
        assert procs[0].wait(30) != 0
        wait_until(lambda: container_id(head, "node") is None, 30, "the head container to go")
        os.killpg(procs[1].pid, signal.SIGTERM)
        procs[1].wait(30)
        wait_until(lambda: container_id(worker, "node") is None, 30, "the worker container")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for host in (head, worker):
            host.docker(["rm", "--force", "node"], check=False)


def test_run_cluster_sh_usage_errors(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "run_cluster.sh"), IMAGE, "10.0.0.1", "--boss",
                             "/tmp"], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2
    assert "must be --head or --worker, not '--boss'" in result.stderr


def test_cluster_up_head_and_worker_on_this_node(cluster_hosts, tmp_path):
    head, worker = cluster_hosts[0], cluster_hosts[1]
    try:
        up = ["env", "COLUMNS=200", LLMCTL, "cluster", "up", "--image", IMAGE, "--num-gpus", "1"]
        up_head = head.run([*up, "--head", "--ip", head.ip])
        assert "created" in up_head.stdout
        up_worker = worker.run([*up, "--worker", "--ip", worker.ip, "--head-ip", head.ip])
        assert "created" in up_worker.stdout
        wait_until(lambda: active_nodes(head, "llmctl-ray-head") == 2, 60, "the worker to join")
        env = container_env(worker, "llmctl-ray-worker")
        assert env["VLLM_HOST_IP"] == worker.ip and env["GLOO_SOCKET_IFNAME"] == "eth0"
        again = head.run([*up, "--head", "--ip", head.ip])
        assert "unchanged" in again.stdout
        wrong = head.run([LLMCTL, "cluster", "up", "--head", "--ip", "10.77.0.50", "--image",
                          IMAGE], check=False)  # fmt: skip
        assert wrong.returncode == 1 and "10.77.0.50 is not an address of this node" in (
            wrong.stderr
        )
    finally:
        for host in (head, worker):
            down = host.run([LLMCTL, "cluster", "down"], check=False)
            assert down.returncode == 0, down.stderr
        assert container_id(head, "llmctl-ray-head") is None
        assert container_id(worker, "llmctl-ray-worker") is None
