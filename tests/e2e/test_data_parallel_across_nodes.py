"""Data-parallel replicas on two "nodes" (vLLM's multi-node flags), as a user starts them: the
head runs `llmctl serve MODEL -dp 2 --data-parallel-size-local 1 --data-parallel-address
127.0.0.1 --data-parallel-rpc-port P` (API, router, replica 0), the other node `llmctl serve
MODEL -dp 2 --data-parallel-size-local 1 --data-parallel-start-rank 1 ... --headless` (replica
1), as two process trees (two sessions) on 127.0.0.1.

Concurrent requests reach both replicas (/metrics' `replica` label) and the greedy answers equal
the single engine's; a node claiming a rank already taken, or with another -dp, is refused by
name while the group runs; killing the remote node fails its request in flight, /health turns
degraded naming replica 1 and its host, and the head serves on with replica 0; the remote node
started again rejoins the running head and serves again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import Streams, live_pids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.distributed.ports import free_port

TINY_ARGS = ("--dtype", "float32", "--kv-cache-space-gib", "0.02", "--served-model-name", "tiny")
LLMCTL = str(Path(sys.executable).with_name("llmctl"))
PROMPTS = [[5, 6, 7], [100, 2000, 30, 4, 900, 12, 77], [42] * 19, [9, 8, 7, 6]]


def dp_flags(port: int) -> tuple[str, ...]:
    """Two replicas, one on each node, joining at 127.0.0.1:port."""
    return ("-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
            "127.0.0.1", "--data-parallel-rpc-port", str(port))  # fmt: skip


def headless_node(model: str, port: int, *extra: str, timeout: float = 240) -> subprocess.Popen:
    return subprocess.Popen(
        [
            LLMCTL,
            "serve",
            model,
            *TINY_ARGS,
            *dp_flags(port),
            "--data-parallel-start-rank",
            "1",
            "--headless",
            "--rendezvous-timeout",
            str(timeout),
            *extra,
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


def per_replica(url: str, name: str) -> dict[str, float]:
    return sample(url, name)[name]


def sample(url: str, *names: str) -> dict[str, dict[str, float]]:
    """{metric: {replica: value}} from one scrape of /metrics (one reading of every replica)."""
    import re

    found: dict[str, dict[str, float]] = {name: {} for name in names}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in names:
            match = re.fullmatch(rf'{re.escape(name)}\{{.*replica="(\d+)".*\}} (\S+)', line)
            if match:
                found[name][match[1]] = float(match[2])
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Group:
    model: str
    port: int  # --data-parallel-rpc-port
    head: Any  # conftest's Server
    node: subprocess.Popen


@pytest.fixture(scope="module")
def group(tiny_models, server_factory):
    model = str(tiny_models.path("llama"))
    port = free_port()
    node = headless_node(model, port)  # first: it waits for the head, as it may on real hosts
    try:
        head = server_factory(model, *TINY_ARGS, *dp_flags(port), quiet=False)
        yield Group(model, port, head, node)
    finally:
        kill_session(node)


async def complete(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": p,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )  # fmt: skip
                for p in prompts
            )
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["token_ids"] for r in replies]


def test_both_nodes_serve_and_match_the_single_engine(group):
    assert "Data-parallel replica 1 joined from host" in group.head.output()
    with LLM(
        group.model,
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        distributed_executor_backend="uni",
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        offline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # concurrent and long enough to overlap: the router spreads them over both replicas
    assert asyncio.run(complete(group.head.url, PROMPTS, 64)) == offline
    prompt_tokens = per_replica(group.head.url, "llmctl:prompt_tokens_total")
    assert set(prompt_tokens) == {"0", "1"} and all(v > 0 for v in prompt_tokens.values())
    assert per_replica(group.head.url, "llmctl:engine_alive") == {"0": 1.0, "1": 1.0}
    health = httpx.get(f"{group.head.url}/health", timeout=10).json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        ((), "data-parallel replica rank 1 was given twice: it already joined from host"),
        (("--data-parallel-start-rank", "0"),
         "data-parallel replica rank 0 was given twice: the head runs replicas 0 to 0 itself"),
    ],
)  # fmt: skip
def test_a_rank_given_twice_is_refused_while_the_group_runs(group, extra, message):
    intruder = headless_node(group.model, group.port, *extra, timeout=20)
    try:
        out, _ = intruder.communicate(timeout=120)
    finally:
        kill_session(intruder)
    assert intruder.returncode == 1, out
    assert message in out
    assert "--data-parallel-start-rank" in out  # the hint


def test_a_client_that_goes_away_aborts_its_request_on_the_remote_node(group):
    head = group.head
    generated = "llmctl:generation_tokens_total"
    before = per_replica(head.url, generated)
    streams = [
        head.client().completions.create(
            model="tiny",
            prompt=[11 + i] * 5,
            max_tokens=250,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for i in range(2)
    ]
    for stream in streams:
        next(iter(stream))  # streaming: the request runs on its replica
    for stream in streams:
        stream.close()  # the client disconnects mid-stream
    after: dict[str, float] = {}

    def gone() -> bool:
        # One request on each replica: each generated tokens; running 0 in the same scrape (the
        # remote node reports every 0.25 s, and a report from before its request ran says 0
        # too), so these counts are those after the abort.
        now = sample(head.url, "llmctl:num_requests_running", generated)
        after.update(now[generated])
        return now["llmctl:num_requests_running"] == {"0": 0.0, "1": 0.0} and all(
            after[r] > before[r] for r in before
        )

    wait_until(gone, 30, "a request to run on each replica, then go")
    # aborted, not finished: each replica generated fewer than its request's 250 tokens
    assert all(after[r] - before[r] < 250 for r in ("0", "1")), (before, after)


def test_killing_the_remote_node_degrades_health_and_the_head_serves_on(group):
    head = group.head
    requests = [dict(model="tiny", prompt=[7 + i] * 5, max_tokens=200,
                     extra_body={"ignore_eos": True}) for i in range(2)]  # fmt: skip
    streams = Streams(head.client, requests)
    streams.wait_streaming()  # both run, one on each replica (the outcomes below say so)
    kill_session(group.node)
    outcomes = streams.join(120)
    assert sorted(o[0] for o in outcomes) == ["error", "finished"], outcomes
    [(_, message)] = [o for o in outcomes if o[0] == "error"]
    assert "data-parallel replica 1 on host" in message, outcomes

    health = httpx.get(f"{head.url}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded"
    assert "replica 1: data-parallel replica 1 on host" in body["message"], body
    assert "lost its connection to the head" in body["message"]
    assert [r["alive"] for r in body["replicas"]] == [True, False]
    assert per_replica(head.url, "llmctl:engine_alive") == {"0": 1.0, "1": 0.0}

    # new requests go to the survivor and succeed
    assert len(asyncio.run(complete(head.url, PROMPTS, 4))) == len(PROMPTS)
    assert head.stop() == 0  # and nothing of the head is left (Server.stop checks)


def test_a_head_without_replicas_serves_through_the_other_node(tiny_models, server_factory):
    """vLLM's `--data-parallel-size-local 0`: the head runs the API server alone; the other node
    runs both replicas (start rank 0); SIGTERM on the head ends them, and the node exits 0."""
    model = str(tiny_models.path("llama"))
    port = free_port()
    flags = ("-dp", "2", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
             str(port))  # fmt: skip
    node = subprocess.Popen(
        [
            LLMCTL,
            "serve",
            model,
            *TINY_ARGS,
            *flags,
            "--data-parallel-size-local",
            "2",
            "--headless",
            "--rendezvous-timeout",
            "240",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        head = server_factory(model, *TINY_ARGS, *flags, "--data-parallel-size-local", "0")
        assert not live_pids(parent=head.process.pid)  # no worker on the head
        answers = asyncio.run(complete(head.url, PROMPTS, 64))  # long enough to overlap
        assert [len(a) for a in answers] == [64] * len(PROMPTS)
        prompt_tokens = per_replica(head.url, "llmctl:prompt_tokens_total")
        assert set(prompt_tokens) == {"0", "1"} and all(v > 0 for v in prompt_tokens.values())
        assert head.stop() == 0
        out, _ = node.communicate(timeout=60)
        assert node.returncode == 0, out
        assert "Data-parallel replica 0: the head ended it" in out
        deadline = time.monotonic() + 10
        while live_pids(session=node.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live_pids(session=node.pid)
    finally:
        kill_session(node)


def test_a_node_whose_head_dies_stops_its_replicas_and_names_the_head(tiny_models, server_factory):
    model = str(tiny_models.path("llama"))
    port = free_port()
    node = headless_node(model, port)
    try:
        head = server_factory(model, *TINY_ARGS, *dp_flags(port))
        kill_session(head.process)  # the head's host dies: no "shutdown" reaches the node
        out, _ = node.communicate(timeout=60)
        assert node.returncode == 1, out
        assert (
            f"error: the head at 127.0.0.1:{port} closed its connection to data-parallel "
            "replica 1 without ending it" in out
        )
        deadline = time.monotonic() + 10
        while live_pids(session=node.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live_pids(session=node.pid)  # its replica's worker stopped too
    finally:
        kill_session(node)


def test_a_stopped_remote_node_is_declared_stalled_after_the_stall_timeout(
    tiny_models, server_factory
):
    """SIGSTOP on the node (its host hangs): the head hears nothing from replica 1 for
    --stall-timeout seconds, fails its request in flight and serves on with replica 0; the node,
    continued, finds its connection closed and stops its replica."""
    model = str(tiny_models.path("llama"))
    port = free_port()
    node = headless_node(model, port)
    try:
        head = server_factory(model, *TINY_ARGS, *dp_flags(port), "--stall-timeout", "3")
        requests = [dict(model="tiny", prompt=[21 + i] * 5, max_tokens=250,
                         extra_body={"ignore_eos": True}) for i in range(2)]  # fmt: skip
        streams = Streams(head.client, requests)
        streams.wait_streaming()  # both run, one on each replica (the outcomes below say so)
        os.kill(node.pid, signal.SIGSTOP)
        outcomes = streams.join(120)
        assert sorted(o[0] for o in outcomes) == ["error", "finished"], outcomes
        body = httpx.get(f"{head.url}/health", timeout=10).json()
        assert body["status"] == "degraded"
        assert "replica 1: data-parallel replica 1 on host" in body["message"]
        assert "sent nothing for 3 s" in body["message"], body
        assert len(asyncio.run(complete(head.url, PROMPTS[:2], 4))) == 2
        os.kill(node.pid, signal.SIGCONT)
        out, _ = node.communicate(timeout=60)
        assert node.returncode == 1
        assert "closed its connection to data-parallel replica 1 without ending it" in out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGCONT)
        kill_session(node)


def test_a_restarted_remote_node_rejoins_the_running_head(tiny_models, server_factory):
    """The remote node dies and is started again with the same --data-parallel-start-rank: it
    joins the running head, /health turns ok again, and replica 1 takes requests again."""
    model = str(tiny_models.path("llama"))
    port = free_port()
    node = headless_node(model, port)
    again = None
    try:
        head = server_factory(model, *TINY_ARGS, *dp_flags(port), quiet=False)
        status = lambda: httpx.get(f"{head.url}/health", timeout=10).json()  # noqa: E731
        kill_session(node)
        wait_until(lambda: status()["status"] == "degraded", 60, "replica 1 reported lost")
        again = headless_node(model, port)  # the node started again, same start rank
        alive = lambda: per_replica(head.url, "llmctl:engine_alive")  # noqa: E731
        wait_until(lambda: alive() == {"0": 1.0, "1": 1.0}, 240, "replica 1 serving again")
        body = status()
        assert body["status"] == "ok" and len(body["replicas"]) == 2, body
        assert "Data-parallel replica 1 joined again from host" in head.output()
        answers = asyncio.run(complete(head.url, PROMPTS, 64))  # long enough to overlap
        assert [len(a) for a in answers] == [64] * len(PROMPTS)
        prompt_tokens = per_replica(head.url, "llmctl:prompt_tokens_total")
        assert prompt_tokens.get("1", 0) > 0, prompt_tokens  # the new replica 1 served
        assert head.stop() == 0
        out, _ = again.communicate(timeout=60)
        assert again.returncode == 0, out
        assert "Data-parallel replica 1: the head ended it" in out
    finally:
        kill_session(node)
        if again is not None:
            kill_session(again)
