"""--restart-on-failure across two "nodes" without Ray, as a user starts them (two process trees on
127.0.0.1, pp=2: stage 0 on node 0, stage 1 on the --headless node 1). The rank on node 1 is
SIGSTOPped mid-stream: node 0's /health turns 503 naming it (its state comes from node 1's agent),
the stream gets an error, node 1's agent kills the stopped worker, joins node 0's next group, and
the endpoint gives the same greedy answer again. A second failure is past --max-restarts 1: node 0
stays down saying why, node 1's agent exits naming the failure; SIGTERM on node 0 leaves nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest
from support import alive, live_pids
from test_serve_across_nodes import LLMCTL, TINY_ARGS, kill_session, master_port, wait_gone
from test_stall_health import greedy, health, stop_a_rank_mid_stream, wait_for

STALL_TIMEOUT = 3.0
RESTART = ("--restart-on-failure", "--max-restarts", "1")


def group_args(port: int) -> tuple[str, ...]:
    return (
        "-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--rendezvous-timeout", "60", *RESTART,
    )  # fmt: skip


@pytest.fixture
def node1(tiny_models):
    """Node 1's agent, started first (it waits for node 0); its session is killed at the end."""
    model = str(tiny_models.path("llama"))
    port = master_port()
    process = subprocess.Popen(
        [LLMCTL, "serve", model, *group_args(port), "--node-rank", "1", "--headless"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    process.model, process.master_port = model, port
    yield process
    kill_session(process)


def worker_of(node1) -> int:
    """Node 1's one worker process (its agent's child), once it runs."""
    return wait_for(lambda: len(p := live_pids(parent=node1.pid)) == 1 and p.pop(), 60, "worker")


def test_a_stopped_rank_on_a_headless_node_restarts_the_group_on_both_nodes(server_factory, node1):
    node0 = server_factory(
        node1.model, *TINY_ARGS, *group_args(node1.master_port),
        "--stall-timeout", f"{STALL_TIMEOUT:g}",
    )  # fmt: skip
    before = greedy(node0)
    stopped = worker_of(node1)
    thread, outcome, _ = stop_a_rank_mid_stream(node0, stopped)

    down = wait_for(lambda: (r := health(node0)).status_code == 503 and r, 30, "/health 503")
    message = down.json()["error"]["message"]
    assert f"worker rank 1 (pid {stopped}) is stopped (SIGSTOP)" in message, message
    thread.join(30)
    assert not thread.is_alive() and outcome[0][0] == "error", outcome
    wait_for(lambda: not alive(stopped), 30, "the stopped worker on node 1 killed")

    up = wait_for(lambda: (r := health(node0)).status_code == 200 and r, 180, "/health 200")
    assert up.json()["restarts"] == 1
    assert "worker rank 1" in up.json()["last_failure"]
    assert greedy(node0) == before
    restarted = worker_of(node1)
    assert restarted != stopped

    # A second failure is past --max-restarts 1 on both nodes.
    os.kill(restarted, signal.SIGKILL)
    out, _ = node1.communicate(timeout=60)
    assert node1.returncode == 1, out
    assert "joining node 0's next group (restart 1 of 1" in out, out
    assert "node 0 ended the group: worker rank 1" in out and "SIGKILL" in out, out
    assert not wait_gone(node1.pid)
    down = wait_for(lambda: (r := health(node0)).status_code == 503 and r, 30, "/health 503")
    assert "SIGKILL" in down.json()["error"]["message"]
    assert httpx.post(f"{node0.url}/v1/completions", json={"prompt": "x"}).status_code == 503
    assert node0.stop() == 0  # and nothing of node 0's session is left
