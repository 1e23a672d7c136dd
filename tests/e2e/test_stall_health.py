"""A stuck engine, as a client and a monitor see it: `llmctl serve` with tp=2 on the mp backend,
one worker rank SIGSTOPped mid-stream. /health turns 503 within --stall-timeout (naming the
stopped rank), the stream in flight gets an error instead of waiting forever, no process is left
behind; with --restart-on-failure the server starts its engine again and answers as before."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from support import alive, live_pids

STALL_TIMEOUT = 3.0
TINY_ARGS = (
    "--dtype", "float32", "--kv-cache-space-gib", "0.05", "--served-model-name", "tiny",
    "-tp", "2", "--distributed-executor-backend", "mp", "--stall-timeout", f"{STALL_TIMEOUT:g}",
)  # fmt: skip
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return str(tiny_models.path("llama"))


def wait_for(condition, timeout: float, what: str):
    """Poll `condition()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def health(server) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=5)


def workers_of(server) -> list[int]:
    """The server's worker processes, by rank (ranks start in order, so their pids rise)."""
    workers = sorted(live_pids(parent=server.process.pid))
    assert len(workers) == 2, workers
    return workers


def greedy(server) -> str:
    out = server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def stop_a_rank_mid_stream(server, pid: int) -> tuple[threading.Thread, list, float]:
    """Start a long stream; SIGSTOP `pid` once its first chunk arrived. Returns the stream's
    thread, its outcome (filled when it ends) and when the rank was stopped."""
    outcome: list = []
    stopped = threading.Event()
    stopped_at: list[float] = []

    def stream() -> None:
        chunks = 0
        try:
            for _ in server.client().completions.create(
                model="tiny", prompt=PROMPT, max_tokens=240, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                chunks += 1
                if chunks == 1:
                    os.kill(pid, signal.SIGSTOP)
                    stopped_at.append(time.monotonic())
                    stopped.set()
            outcome.append(("finished", chunks))
        except openai.APIError as exc:
            outcome.append(("error", chunks, str(exc)))
        finally:
            stopped.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert stopped.wait(60) and stopped_at, outcome
    return thread, outcome, stopped_at[0]


def test_a_stopped_rank_turns_health_503_fails_the_stream_and_leaves_no_process(
    server_factory, tiny
):
    server = server_factory(tiny, *TINY_ARGS)
    assert health(server).json()["restarts"] == 0
    workers = workers_of(server)
    thread, outcome, stopped_at = stop_a_rank_mid_stream(server, workers[1])

    answer = wait_for(lambda: (r := health(server)).status_code == 503 and r, 30, "/health 503")
    # Detected within the stall timeout plus the watchdog's period and a loaded machine's margin.
    assert time.monotonic() - stopped_at < STALL_TIMEOUT + 5
    message = answer.json()["error"]["message"]
    assert f"--stall-timeout {STALL_TIMEOUT:g}" in message, message
    assert f"worker rank 1 (pid {workers[1]}) is stopped (SIGSTOP)" in message, message

    thread.join(30)
    assert not thread.is_alive()  # the stream ended: an error, not an endless wait
    assert outcome[0][0] == "error" and outcome[0][1] < 240, outcome
    assert "no engine step completed" in outcome[0][2], outcome

    # The engine group is torn down (the stopped worker too); the server stays up, saying why.
    wait_for(lambda: not live_pids(parent=server.process.pid), 30, "workers gone")
    assert not alive(workers[1])
    answer = health(server)
    assert answer.status_code == 503
    assert "no engine step completed" in answer.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert response.status_code == 503
    assert server.metric("llmctl:engine_alive") == 0
    assert server.stop() == 0  # and no process of its session is left


def test_restart_on_failure_brings_the_endpoint_back_with_the_same_answers(server_factory, tiny):
    server = server_factory(tiny, *TINY_ARGS, "--restart-on-failure", "--max-restarts", "2")
    before = greedy(server)
    workers = workers_of(server)
    thread, outcome, _ = stop_a_rank_mid_stream(server, workers[1])

    down = wait_for(lambda: (r := health(server)).status_code == 503 and r, 30, "/health 503")
    assert "rank 1" in down.json()["error"]["message"]
    thread.join(30)
    assert not thread.is_alive() and outcome[0][0] == "error", outcome

    up = wait_for(lambda: (r := health(server)).status_code == 200 and r, 120, "/health 200")
    assert up.json()["restarts"] == 1
    assert "worker rank 1" in up.json()["last_failure"]
    assert not alive(workers[1])  # the stopped worker was killed, not left behind
    assert not set(workers_of(server)) & set(workers)  # a new engine group
    assert greedy(server) == before
    assert server.metric("llmctl:engine_restarts_total") == 1

    # A rank that dies is a failure too: the second restart.
    new_workers = workers_of(server)
    os.kill(new_workers[0], signal.SIGKILL)
    wait_for(lambda: health(server).status_code == 503, 30, "/health 503 after SIGKILL")
    up = wait_for(lambda: (r := health(server)).status_code == 200 and r, 120, "/health 200")
    assert up.json()["restarts"] == 2
    assert "SIGKILL" in up.json()["last_failure"]
    assert greedy(server) == before
    assert server.stop() == 0
