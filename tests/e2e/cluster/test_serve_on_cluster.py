"""One model served across two real hosts: `llmctl cluster up`, then `llmctl serve -i` runs the
server in the head container on the Ray backend (pipeline stages on different nodes, tensor
parallel inside each), and the official openai client gets the offline engine's greedy answers.
Two data-parallel replicas on the same cluster: Ray places one on each node. Then the worker's
container is killed while a request runs: /health turns 503, the request fails,
`cluster status` names the node.

Both tests serve the bundled GGUF file (the same path on every host), which each rank reads in
place: its own slice of the quantized weights, no converted copy on any node."""

from __future__ import annotations

import re
import subprocess
import threading
import time

import httpx
import openai
import pytest
import yaml
from test_launcher import IMAGE, llmctl

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.model_loader.default_model import default_model_path

PORT = 8011
PROMPTS = ["The capital of France is", "def add(a, b):"]
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-space-gib", "0.1"]
ENGINE += ["--served-model-name", "smol"]


@pytest.fixture(scope="module")
def model() -> str:
    return str(default_model_path())  # inside .venv: the same path on every test host


@pytest.fixture(scope="module")
def offline(model) -> list[str]:
    llm = LLM(model, dtype="float32", max_model_len=512, kv_cache_space_gib=0.1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def inventory(path, testbed, hosts, model: str, gpus: int):
    doc = {
        "name": "srv",
        "image": IMAGE,
        "model": model,
        "ssh": {"user": "root", "key": str(testbed.client_key)},
        "nodes": [{"host": h.ip, "head": i == 0, "gpus": gpus} for i, h in enumerate(hosts)],
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def hosts(testbed, llmctl_image):
    return testbed.docker_hosts[:2]


API_KEY_FILE = "/root/.llmctl/srv-api.env"  # on the head node: what `serve -i` made


def api_key(head) -> str:
    """The API key `serve -i` made for the cluster, read from its 0600 env file on the head."""
    found = head.run(["cat", API_KEY_FILE], check=False).stdout.strip()
    return found.removeprefix("LLMCTL_API_KEY=") or "none"


def client(head) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{head.ip}:{PORT}/v1", api_key=api_key(head), max_retries=0
    )


def command_lines(hosts, container: str) -> str:
    """Every process's command line on this machine (whose process table the hosts and their
    containers share: what `ps -eo args` shows on a host), and as each container sees its own."""
    seen = [subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout]
    own = ("import glob; print('\\n'.join(open(f, 'rb').read().replace(b'\\0', b' ')"
           ".decode(errors='replace') for f in glob.glob('/proc/[0-9]*/cmdline')))")  # fmt: skip
    for host in hosts:
        seen.append(host.docker(["exec", container, "python3", "-c", own]).stdout)
    return "\n".join(seen)


def secrets_on_no_command_line(hosts, container: str, cluster: str) -> None:
    """The cluster secret (each node's env file) and the API key are in no process's argv."""
    values = [api_key(hosts[0])]
    for host in hosts:
        env = host.run(["cat", f"/root/.llmctl/{cluster}-{host.ip}.env"]).stdout
        values += [line.split("=", 1)[1] for line in env.splitlines()
                   if line.startswith("LLMCTL_CLUSTER_SECRET=")]  # fmt: skip
    assert len(values) == 1 + len(hosts) and len(set(values[1:])) == 1, "one secret per cluster"
    lines = command_lines(hosts, container)
    assert "llmctl serve" in lines  # the servers are there, their secrets are not
    for value in values:
        assert len(value) >= 32 and value not in lines


def greedy(head) -> list[str]:
    out = []
    for prompt in PROMPTS:
        c = client(head).completions.create(
            model="smol", prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        out.append(c.choices[0].text)
    return out


def authorization(head) -> dict[str, str]:
    """What a client of the cluster's server sends: every route but /health needs the key."""
    return {"Authorization": f"Bearer {api_key(head)}"}


def metric(head, name: str) -> float:
    text = httpx.get(
        f"http://{head.ip}:{PORT}/metrics", headers=authorization(head), timeout=5
    ).text
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def health(head) -> int:
    return httpx.get(f"http://{head.ip}:{PORT}/health", timeout=5).status_code


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def rank_nodes(cli_env, inv) -> dict[int, str]:
    log = llmctl(cli_env, "cluster", "exec", "head", "-i", str(inv), "--", "cat",
                 "/root/.llmctl/server.log").stdout  # fmt: skip
    ranks = re.findall(r"Ray worker rank (\d+) on node (\S+), pid", log)
    return {int(r): ip for r, ip in ranks[-4:]} if ranks else {}


def test_pipeline_stages_on_two_nodes(cli_env, testbed, hosts, model, offline, tmp_path):
    inv = inventory(tmp_path / "srv.yaml", testbed, hosts, model, gpus=1)
    try:
        llmctl(cli_env, "cluster", "up", "-i", str(inv))
        out = llmctl(cli_env, "serve", "-i", str(inv), "-pp", "2", "--port", str(PORT), *ENGINE)
        head, worker = hosts
        assert f"at http://{head.ip}:{PORT}/v1" in out.stdout, out.stdout + out.stderr
        assert f"API key: LLMCTL_API_KEY in {head.ip}:{API_KEY_FILE} (mode 0600" in out.stdout
        assert greedy(head) == offline
        assert httpx.get(f"http://{head.ip}:{PORT}/v1/models", timeout=5).status_code == 401
        placed = rank_nodes(cli_env, inv)
        assert placed == {0: head.ip, 1: worker.ip}, placed  # stage 0 on the head, 1 on the worker
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        assert re.search(r"Server: .* \(tp=1, pp=2\) at .*: healthy", status), status
        assert "Joins: authenticated: the 2 nodes share one cluster secret" in status, status
        assert f"API key: LLMCTL_API_KEY in {head.ip}:{API_KEY_FILE}" in status, status
        secrets_on_no_command_line(hosts, "llmctl-srv", "srv")
        again = llmctl(cli_env, "serve", "-i", str(inv), "-pp", "2", "--port", str(PORT), *ENGINE)
        assert "serving" in again.stdout  # the same server, found healthy
        stopped = llmctl(cli_env, "serve", "-i", str(inv), "--stop").stdout
        assert "server stopped" in stopped

        # Two data-parallel replicas on the same Ray cluster: Ray places each replica's worker
        # (a bundle of one GPU) on a node of its own. While replica 0 streams a long answer,
        # the router gives the prompts to replica 1: the same greedy answers.
        out = llmctl(cli_env, "serve", "-i", str(inv), "-dp", "2", "--port", str(PORT), *ENGINE)
        assert "(dp=2, tp=1, pp=1," in out.stdout, out.stdout + out.stderr
        long = client(head).completions.create(
            model="smol", prompt="Count:", max_tokens=300, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(long))  # replica 0 holds it
        assert greedy(head) == offline
        long.close()
        log = llmctl(cli_env, "cluster", "exec", "head", "-i", str(inv), "--", "cat",
                     "/root/.llmctl/server.log").stdout  # fmt: skip
        assert "Started 2 data-parallel replicas" in log, log
        placed = re.findall(r"Ray worker rank 0 on node (\S+), pid", log)[-2:]
        assert sorted(placed) == sorted([head.ip, worker.ip]), placed
        metrics = httpx.get(
            f"http://{head.ip}:{PORT}/metrics", headers=authorization(head), timeout=5
        ).text
        served = re.findall(
            r'llmctl:prompt_tokens_total\{[^}]*replica="(\d)"[^}]*\} (\S+)', metrics
        )
        assert sorted(r for r, tokens in served if float(tokens) > 0) == ["0", "1"], served
        llmctl(cli_env, "serve", "-i", str(inv), "--stop")
    finally:
        llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)


def test_tp2_inside_nodes_pp2_across_and_a_dying_worker(
    cli_env, testbed, hosts, model, offline, tmp_path
):
    inv = inventory(tmp_path / "srv.yaml", testbed, hosts, model, gpus=2)
    head, worker = hosts
    try:
        llmctl(cli_env, "cluster", "up", "-i", str(inv))
        # No -tp/-pp: the layout comes from the plan (or the seeds' rule: tp = GPUs per node).
        out = llmctl(cli_env, "serve", "-i", str(inv), "--port", str(PORT), *ENGINE)
        assert "(tp=2, pp=2" in out.stdout, out.stdout + out.stderr
        assert greedy(head) == offline
        placed = rank_nodes(cli_env, inv)
        assert placed == {0: head.ip, 1: head.ip, 2: worker.ip, 3: worker.ip}, placed

        # The worker's node dies while a long request runs.
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
        # Killed once the request generates: hundreds of its 400 tokens are still to come.
        wait_until(lambda: metric(head, generated) > before, 60, "the long request to generate")
        worker.docker(["kill", "llmctl-srv"])
        wait_until(lambda: health(head) == 503, 30, "/health to report the dead worker")
        thread.join(60)
        assert not thread.is_alive() and len(errors) == 1, errors
        status = llmctl(cli_env, "cluster", "status", "-i", str(inv)).stdout
        row = next(line for line in status.splitlines() if worker.ip in line)
        assert "exited" in row, status
        assert "unhealthy (503)" in status
    finally:
        llmctl(cli_env, "cluster", "down", "-i", str(inv), check=False)
