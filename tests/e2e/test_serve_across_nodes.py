"""`llmctl serve` across two "nodes" without Ray, as a user starts it: node 1 runs `llmctl serve
... --nnodes 2 --node-rank 1 --headless`, node 0 `llmctl serve ... --nnodes 2`, as two process
trees (two sessions) on 127.0.0.1. tp=2 x pp=2: node 0 runs ranks 0-1 (stage 0), node 1 ranks 2-3
(stage 1); the API's greedy tokens equal the offline single-process engine's. While the group
runs, a second node with the same rank and a second node 0 on the same port are refused by name;
SIGTERM on node 0 ends the group on both nodes with nothing left."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import live_pids

from llmctl.engine import LLM, SamplingParams

LAYOUT = ("-tp", "2", "-pp", "2")
TINY_ARGS = ("--dtype", "float32", "--kv-cache-space-gib", "0.02", "--served-model-name", "tiny")
LLMCTL = str(Path(sys.executable).with_name("llmctl"))
PROMPTS = [[5, 6, 7], [100, 2000, 30, 4, 900, 12, 77], [42] * 19]


def master_port() -> int:
    """A port free on 127.0.0.1 whose successor (the executor's port) is free too."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def headless(model: str, port: int, timeout: float = 240) -> subprocess.Popen:
    return subprocess.Popen(
        [
            LLMCTL,
            "serve",
            model,
            *LAYOUT,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--headless",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--rendezvous-timeout",
            str(timeout),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_session(process: subprocess.Popen) -> None:
    for pid in live_pids(session=process.pid) | {process.pid}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def wait_gone(session: int, timeout: float = 30) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := live_pids(session=session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@dataclass
class Group:
    model: str
    port: int  # --master-port
    node0: Any  # conftest's Server: `llmctl serve` on node 0
    node1: subprocess.Popen


@pytest.fixture(scope="module")
def group(tiny_models, server_factory):
    model = str(tiny_models.path("llama"))
    port = master_port()
    node1 = headless(model, port)  # first: it waits for node 0, as it may on real hosts
    try:
        node0 = server_factory(
            model,
            *LAYOUT,
            *TINY_ARGS,
            "--nnodes",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            quiet=False,
        )
        yield Group(model, port, node0, node1)
    finally:
        kill_session(node1)


def test_tp2_pp2_on_two_nodes_matches_the_offline_engine(group):
    assert "2 nodes" in group.node0.output()  # Started 4 worker processes (tp=2, pp=2, 2 nodes)
    with LLM(
        group.model,
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        distributed_executor_backend="uni",
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        offline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, expected in zip(PROMPTS, offline, strict=True):
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = httpx.post(f"{group.node0.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected


def test_a_second_node_with_the_same_rank_is_refused(group):
    second = headless(group.model, group.port, timeout=30)
    try:
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 1, out
        assert "node rank 1 has already joined node 0's group" in out
        assert "give each node its own --node-rank from 1 to 1" in out
        assert not wait_gone(second.pid)
    finally:
        kill_session(second)
    assert httpx.get(f"{group.node0.url}/health", timeout=10).status_code == 200


def test_a_second_node_0_on_the_same_master_port_is_refused(group):
    second = subprocess.Popen(
        [
            LLMCTL,
            "serve",
            group.model,
            *LAYOUT,
            *TINY_ARGS,
            "--nnodes",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(group.port),
            "--rendezvous-timeout",
            "20",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 1, out
        assert f"port {group.port} (torch.distributed's rendezvous) is already in use" in out
        assert "choose a free --master-port on every node" in out
        assert not wait_gone(second.pid)
    finally:
        kill_session(second)
    assert httpx.get(f"{group.node0.url}/health", timeout=10).status_code == 200


def test_sigterm_on_node_0_ends_the_group_on_both_nodes(group):
    assert group.node0.stop() == 0  # asserts nothing of node 0's session is left
    out, _ = group.node1.communicate(timeout=60)
    assert group.node1.returncode == 0, out
    assert "Node 1: node 0 ended the group" in out
    assert not wait_gone(group.node1.pid)
