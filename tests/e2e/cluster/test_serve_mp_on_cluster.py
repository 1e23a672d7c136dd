"""One model served across two real hosts without Ray: `llmctl image build --no-ray`, `llmctl
cluster up --backend mp` (containers with the model and the env, nothing joined), then `llmctl
serve -i --backend mp` runs `llmctl serve --nnodes 2 --node-rank R --master-addr HEAD` in each
node's container (node 0 serves the API, node 1 is --headless) and the official openai client
gets the offline engine's greedy answers. With --restart-on-failure, a SIGSTOPped rank on the
worker host turns /health 503 naming it, fails the stream in flight, and the group restarts on
both hosts (the stopped worker killed) with the same answers. A worker that cannot reach node 0,
and a master port already in use on the head, are named by `serve -i`.

Both tests serve the bundled GGUF file (the same path on every host), as the Ray tests do."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import httpx
import openai
import pytest
import testbed_image
from test_launcher import LLMCTL, llmctl
from test_serve_on_cluster import (
    API_KEY_FILE,
    ENGINE,
    PROMPTS,
    client,
    greedy,
    health,
    inventory,
    metric,
    secrets_on_no_command_line,
    wait_until,
)

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.kernels.cpu.cpu_kernels import KERNELS
from llmctl.engine.model_loader.default_model import default_model_path

IMAGE = "llmctl:e2e" + testbed_image.NO_RAY_SUFFIX
PORT = 8011
CONTAINER = "llmctl-srv"
STALL_TIMEOUT = 10
SUPERVISED = ["--restart-on-failure", "--stall-timeout", str(STALL_TIMEOUT)]


@pytest.fixture(scope="module")
def model() -> str:
    return str(default_model_path())  # inside .venv: the same path on every test host


@pytest.fixture(scope="module")
def offline(model) -> list[str]:
    llm = LLM(model, dtype="float32", max_model_len=512, kv_cache_space_gib=0.1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def hosts(testbed, llmctl_image):
    """Two hosts with the image without Ray: built by `llmctl image build --no-ray` on the root
    daemon and loaded on each host's daemon, by the bed's preparation in the background
    (testbed_image.py); here both steps find it up to date, or do it when they do not."""
    argv = [LLMCTL, "image", "build", "--debootstrap", "--no-ray", "--tag", IMAGE]
    built = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "without Ray" in built.stdout, built.stdout
    hosts = testbed.docker_hosts[:2]
    testbed_image.load(testbed.root, IMAGE, [h.docker_host for h in hosts])
    return hosts


def mp_inventory(path, testbed, hosts, model: str, gpus: int):
    inv = inventory(path, testbed, hosts, model, gpus)
    inv.write_text(inv.read_text().replace("image: llmctl:e2e\n", f"image: {IMAGE}\n"))
    return inv


def server_log(cli_env, inv, node: str) -> str:
    return llmctl(cli_env, "cluster", "exec", node, "-i", str(inv), "--", "cat",
                  "/root/.llmctl/server.log").stdout  # fmt: skip


def test_pipeline_stages_on_two_nodes_without_ray(
    cli_env, testbed, hosts, model, offline, tmp_path
):
    head, worker = hosts
    inv = mp_inventory(tmp_path / "srv.yaml", testbed, hosts, model, gpus=1)
    try:
        up = llmctl(cli_env, "cluster", "up", "-i", str(inv), "--backend", "mp")
        assert "2 nodes ready for the mp backend (no Ray)" in up.stdout, up.stdout + up.stderr
        no_ray = llmctl(cli_env, "cluster", "exec", worker.ip, "-i", str(inv), "--",
                        "python3", "-c", "import ray", check=False)  # fmt: skip
        assert no_ray.returncode == 1 and "No module named 'ray'" in no_ray.stderr
        env = llmctl(cli_env, "cluster", "exec", worker.ip, "-i", str(inv), "--", "env").stdout
        assert f"VLLM_HOST_IP={worker.ip}" in env and "GLOO_SOCKET_IFNAME=eth0" in env
        # The image's CPU kernels, built with it for this CPU: the engine in the container runs
        # them (without them it fell back to plain torch, ~10x slower decode).
        kernels = llmctl(cli_env, "cluster", "exec", worker.ip, "-i", str(inv), "--",
                         "python3", "-m", "llmctl.engine.kernels.cpu.cpu_kernels"
                         ).stdout  # fmt: skip
        assert re.findall(r"CPU ([\w ]+) kernel: ready", kernels) == list(KERNELS), kernels
        # The doctor without Ray: each container's facts, the all-reduce over the rendezvous.
        doctor = llmctl(cli_env, "doctor", "-i", str(inv), "--timeout", "60", "--json")
        payload = json.loads(doctor.stdout)
        bad = [c for c in payload["checks"] if c["status"] == "fail"]
        assert payload["ok"] and not bad, bad
        assert sorted(n["host_ip"] for n in payload["nodes"]) == [head.ip, worker.ip]
        [gloo] = payload["collectives"]
        assert gloo["backend"] == "gloo" and gloo["ok"] and len(set(gloo["nodes"])) == 2
        text = llmctl(cli_env, "doctor", "nccl", "-i", str(inv), "--timeout", "60").stdout
        assert "gloo all-reduce, 2 rank(s)" in text and "correct" in text, text

        serve = ["serve", "-i", str(inv), "--backend", "mp", "-pp", "2", "--port", str(PORT),
                 *ENGINE, *SUPERVISED]  # fmt: skip
        out = llmctl(cli_env, *serve)
        assert f"at http://{head.ip}:{PORT}/v1" in out.stdout, out.stdout + out.stderr
        assert greedy(head) == offline
        # Stage 0 on the head (node 0), stage 1 on the worker (node 1, headless).
        on_head, on_worker = server_log(cli_env, inv, "head"), server_log(cli_env, inv, worker.ip)
        assert "Started 2 worker processes (tp=1, pp=2, 2 nodes)" in on_head, on_head
        assert f"Node 1 joined node 0 at {head.ip}:" in on_worker, on_worker
        assert not re.search(r"CPU [\w ]+ unavailable", on_head + on_worker)  # no kernel fell back

        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        assert re.search(r"Server: .* \(tp=1, pp=2, mp on 2 nodes\) at .*: healthy", status)
        row = next(line for line in status.splitlines() if worker.ip in line)
        assert "running (pid" in row, status
        # The group joined with the cluster secret `cluster up` gave each node (its env file),
        # which no command line shows, on either host or in either container; nor the API key.
        assert "Joins: authenticated: the 2 nodes share one cluster secret" in status, status
        assert f"API key: LLMCTL_API_KEY in {head.ip}:{API_KEY_FILE}" in status, status
        secrets_on_no_command_line(hosts, CONTAINER, "srv")
        again = llmctl(cli_env, *serve)
        assert "serving" in again.stdout  # the same group, found healthy

        # Rank 1 (stage 1, on the worker host) SIGSTOPped mid-stream: node 0's /health turns 503
        # within the stall timeout naming it, the stream fails, and the group restarts.
        pid = int(re.search(r"Node 1: worker processes \[(\d+)\]", on_worker).group(1))
        outcome, stopped_at = stop_mid_stream(
            head, lambda: worker.docker(["exec", CONTAINER, "sh", "-c", f"kill -STOP {pid}"])
        )
        wait_until(lambda: health(head) == 503, STALL_TIMEOUT + 20, "/health 503")
        assert time.monotonic() - stopped_at < STALL_TIMEOUT + 10  # + the watchdog's period
        message = httpx.get(f"http://{head.ip}:{PORT}/health", timeout=5).json()
        assert f"worker rank 1 (pid {pid}) is stopped (SIGSTOP)" in str(message), message
        wait_until(lambda: outcome, 60, "the stream in flight to end")
        assert outcome[0][0] == "error", outcome
        gone = ["exec", CONTAINER, "sh", "-c", f"test ! -e /proc/{pid}"]
        wait_until(lambda: worker.docker(gone, check=False).returncode == 0, 30, "rank 1 gone")
        wait_until(lambda: serving(head), 240, "the group to restart on both hosts")
        assert greedy(head) == offline
        assert "joining node 0's next group (restart 1 of 3" in server_log(cli_env, inv, worker.ip)
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        assert "healthy, 1 engine restarts" in status, status

        stopped = llmctl(cli_env, "serve", "-i", str(inv), "--stop").stdout
        assert "server stopped" in stopped
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        assert status.count("stopped") >= 3, status  # both nodes' processes, and the server
        assert "Node 1: node 0 ended the group" in server_log(cli_env, inv, worker.ip)
    finally:
        llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)


def test_a_worker_that_cannot_reach_node_0_and_a_master_port_in_use_are_named(
    cli_env, testbed, hosts, model, tmp_path
):
    head, worker = hosts
    inv = mp_inventory(tmp_path / "srv.yaml", testbed, hosts, model, gpus=1)
    drop = ["OUTPUT", "-d", head.ip, "-p", "tcp", "--dport", "29502", "-j", "DROP"]
    try:
        llmctl(cli_env, "cluster", "up", "-i", str(inv), "--backend", "mp")
        worker.run(["iptables", "-I", *drop])  # node 0's executor port, from the worker only
        out = llmctl(cli_env, "serve", "-i", str(inv), "--backend", "mp", "-pp", "2",
                     "--port", str(PORT), "--rendezvous-timeout", "10", *ENGINE,
                     check=False)  # fmt: skip
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"the server on {worker.ip} (node 1) exited:" in out.stderr, out.stderr
        assert f"could not reach node 0 at {head.ip}:29502 within 10 s" in out.stderr
        assert "--stop" in out.stderr
        llmctl(cli_env, "serve", "-i", str(inv), "--stop")
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        assert "running (pid" not in status, status
        with pytest.raises(openai.APIConnectionError):  # nothing listens any more
            client(head).models.list()
        worker.run(["iptables", "-D", *drop])

        # The master port taken on the head (by a listener that exits on its first connection).
        listen = "import socket; s = socket.create_server(('', 29501)); s.accept()"
        head.docker(["exec", "-d", CONTAINER, "python3", "-c", listen])
        listening = ["exec", CONTAINER, "grep", "-q", ":733D 00000000:0000 0A", "/proc/net/tcp"]
        wait_until(lambda: head.docker(listening, check=False).returncode == 0, 30, "listening")
        out = llmctl(cli_env, "serve", "-i", str(inv), "--backend", "mp", "-pp", "2",
                     "--port", str(PORT), "--rendezvous-timeout", "10", *ENGINE,
                     check=False)  # fmt: skip
        assert out.returncode == 1, out.stdout + out.stderr
        in_use = "port 29501 (torch.distributed's rendezvous) is already in use on node 0"
        assert f"the server on {head.ip} (node 0) exited: {in_use}" in out.stderr, out.stderr
        assert "which --master-port 29501 asks for" in out.stderr, out.stderr
        knock = f"import socket; socket.create_connection(('{head.ip}', 29501), 5).close()"
        head.docker(["exec", CONTAINER, "python3", "-c", knock])  # the listener ends
        llmctl(cli_env, "serve", "-i", str(inv), "--stop")
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        assert "running (pid" not in status, status
    finally:
        worker.run(["iptables", "-D", *drop], check=False)
        llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)


def test_tp2_inside_nodes_pp2_across_and_a_dying_worker(
    cli_env, testbed, hosts, model, offline, tmp_path
):
    head, worker = hosts
    inv = mp_inventory(tmp_path / "srv.yaml", testbed, hosts, model, gpus=2)
    try:
        llmctl(cli_env, "cluster", "up", "-i", str(inv), "--backend", "mp")
        # No -tp/-pp, no --backend: the plan's layout (or tp = GPUs per node, pp = nodes), on
        # the backend the containers were started for.
        out = llmctl(cli_env, "serve", "-i", str(inv), "--port", str(PORT), *ENGINE)
        assert "(tp=2, pp=2" in out.stdout, out.stdout + out.stderr
        assert greedy(head) == offline
        on_head, on_worker = server_log(cli_env, inv, "head"), server_log(cli_env, inv, worker.ip)
        assert "Started 4 worker processes (tp=2, pp=2, 2 nodes)" in on_head, on_head
        assert re.search(r"Node 1: worker processes .* for global ranks 2-3;", on_worker)

        # The worker's node dies while a long request runs: the request fails, /health says so.
        errors: list[BaseException] = []

        def long_request() -> None:
            try:
                client(head).completions.create(
                    model="smol", prompt="Count:", max_tokens=400, temperature=0,
                    extra_body={"ignore_eos": True}, timeout=120,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        generated = "llmctl:generation_tokens_total"
        before = metric(head, generated)
        thread = threading.Thread(target=long_request)
        thread.start()
        wait_until(lambda: metric(head, generated) > before, 60, "the long request to generate")
        worker.docker(["kill", CONTAINER])
        wait_until(lambda: not serving(head), 60, "the head to report the lost node")
        thread.join(60)
        assert not thread.is_alive() and len(errors) == 1, errors
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        row = next(line for line in status.splitlines() if worker.ip in line)
        assert "exited" in row, status
    finally:
        llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)


def stop_mid_stream(head, stop) -> tuple[list, float]:
    """Stream a long completion; call `stop()` once its first chunk arrived. Returns the
    stream's outcome (filled when it ends: ("finished",) or ("error", message)) and when
    `stop()` returned."""
    outcome: list = []
    stopped = threading.Event()
    stopped_at: list[float] = []

    def stream() -> None:
        try:
            for _ in client(head).completions.create(
                model="smol", prompt="Count:", max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True}, timeout=120,
            ):  # fmt: skip
                if not stopped.is_set():
                    stop()
                    stopped_at.append(time.monotonic())
                    stopped.set()
            outcome.append(("finished",))
        except openai.APIError as exc:
            outcome.append(("error", str(exc)))
        finally:
            stopped.set()

    threading.Thread(target=stream, daemon=True).start()
    assert stopped.wait(120) and stopped_at, outcome
    return outcome, stopped_at[0]


def serving(head) -> bool:
    """/health answers 200 (an engine that lost a node answers 503, or its server exits)."""
    try:
        return health(head) == 200
    except httpx.HTTPError:
        return False


def test_cluster_up_on_this_node_for_the_mp_backend(hosts):
    """`cluster up --head/--worker --backend mp` without an inventory (run_cluster.sh's way):
    this node's idle container with its env and no Ray, and the command to exec in it."""
    head, worker = hosts
    up = [LLMCTL, "cluster", "up", "--image", IMAGE, "--backend", "mp"]
    try:
        out = worker.run([*up, "--worker", "--ip", worker.ip, "--head-ip", head.ip],
                         env={"COLUMNS": "200"})  # fmt: skip
        assert "1 node ready for the mp backend (no Ray)" in out.stdout, out.stdout
        assert (
            "docker exec -d llmctl-mp-worker llmctl serve MODEL -tp T -pp P "
            f"--distributed-executor-backend mp --nnodes N --node-rank R --master-addr {head.ip} "
            "--headless" in out.stdout
        ), out.stdout
        env = worker.docker(["exec", "llmctl-mp-worker", "env"]).stdout
        assert f"VLLM_HOST_IP={worker.ip}" in env and "GLOO_SOCKET_IFNAME=eth0" in env
        again = worker.run([*up, "--worker", "--ip", worker.ip, "--head-ip", head.ip])
        assert "mp backend (no Ray); nothing changed" in again.stdout, again.stdout
    finally:
        down = worker.run([LLMCTL, "cluster", "down"], check=False)
        assert down.returncode == 0, down.stderr
    gone = worker.docker(["container", "inspect", "llmctl-mp-worker"], check=False)
    assert gone.returncode != 0
