"""`llmctl serve --data-parallel-size 2`: one OpenAI endpoint over two engine replicas.

Concurrent requests are spread over both (seen in /metrics' `replica` label); then one replica's
worker is SIGKILLed while both stream: its request fails, the other's finishes, /health says
degraded (naming the replica and the signal), new requests succeed on the survivor, and SIGTERM
leaves no process. With --restart-on-failure a replica that died rejoins once restarted."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
from support import Streams, live_pids

TINY_ARGS = ("--dtype", "float32", "--kv-cache-space-gib", "0.02", "--served-model-name", "tiny")
IGNORE_EOS = {"ignore_eos": True}


def per_replica(server, name: str) -> dict[str, float]:
    """{replica: value} of one metric."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf'{re.escape(name)}\{{.*replica="(\d+)".*\}} (\S+)', line)
        if match:
            found[match[1]] = float(match[2])
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def complete_all(server, prompts: list[str]) -> list[str]:
    client = server.async_client()
    responses = await asyncio.gather(
        *(
            client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
            for p in prompts
        )
    )
    return [r.choices[0].finish_reason for r in responses]


def test_replicas_share_the_load_and_survive_one_death(server_factory, tiny_models):
    server = server_factory(str(tiny_models.path("llama")), *TINY_ARGS, "-dp", "2")
    workers = sorted(live_pids(parent=server.process.pid))
    assert len(workers) == 2  # one worker process per replica
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(8)]
    assert asyncio.run(complete_all(server, prompts)) == ["length"] * 8
    prompt_tokens = per_replica(server, "llmctl:prompt_tokens_total")
    assert set(prompt_tokens) == {"0", "1"} and all(v > 0 for v in prompt_tokens.values())
    assert per_replica(server, "llmctl:engine_alive") == {"0": 1.0, "1": 1.0}

    requests = [dict(model="tiny", prompt=f"long {i}", max_tokens=200, extra_body=IGNORE_EOS)
                for i in range(2)]  # fmt: skip
    streams = Streams(server.client, requests)
    streams.wait_streaming()  # both run, one on each replica (the outcomes below say so)
    os.kill(workers[1], signal.SIGKILL)
    outcomes = streams.join(120)
    # the killed replica's request failed, the other replica's finished
    assert sorted(o[0] for o in outcomes) == ["error", "finished"], outcomes

    alive = per_replica(server, "llmctl:engine_alive")
    assert sorted(alive.values()) == [0.0, 1.0]
    dead = next(r for r, v in alive.items() if v == 0.0)
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded"
    assert f"replica {dead}" in body["message"] and "SIGKILL" in body["message"], body
    assert [r["alive"] for r in body["replicas"]] == [r != dead for r in ("0", "1")]

    # new requests all go to the survivor and succeed
    assert asyncio.run(complete_all(server, prompts[:4])) == ["length"] * 4
    assert server.stop() == 0  # and no process of the server is left (Server.stop checks)


def test_a_restarted_replica_rejoins_routing_and_health(server_factory, tiny_models):
    """--restart-on-failure with -dp 2: a replica whose worker is SIGKILLed while idle is
    restarting (/health degraded, naming it), then serves again: /health ok with its restart
    counted, and requests go to both replicas."""
    server = server_factory(
        str(tiny_models.path("llama")), *TINY_ARGS, "-dp", "2", "--restart-on-failure"
    )
    workers = sorted(live_pids(parent=server.process.pid))
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)

    def body() -> dict:
        response = httpx.get(f"{server.url}/health", timeout=10)
        assert response.status_code == 200  # one replica serves throughout
        return response.json()

    wait_until(lambda: body()["status"] == "degraded", 30, "/health degraded")
    degraded = body()
    assert "1 of 2 data-parallel replicas stopped" in degraded["message"]
    assert "SIGKILL" in degraded["message"], degraded
    [dead] = [r["replica"] for r in degraded["replicas"] if not r["alive"]]

    wait_until(lambda: body()["status"] == "ok", 120, "/health ok again")
    replicas = body()["replicas"]
    assert [r["restarts"] for r in replicas] == [int(i == dead) for i in range(2)]
    assert "SIGKILL" in replicas[dead]["last_failure"]
    assert per_replica(server, "llmctl:engine_alive") == {"0": 1.0, "1": 1.0}
    assert per_replica(server, "llmctl:engine_restarts_total")[str(dead)] == 1.0

    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(8)]
    assert asyncio.run(complete_all(server, prompts)) == ["length"] * 8
    prompt_tokens = per_replica(server, "llmctl:prompt_tokens_total")
    assert all(prompt_tokens[r] > 0 for r in ("0", "1")), prompt_tokens
    assert server.stop() == 0
