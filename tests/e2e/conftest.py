"""A real `llmctl serve` process on loopback, driven by the official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support import live_pids

from llmctl.engine.distributed.ports import free_port

LLMCTL = str(Path(sys.executable).with_name("llmctl"))


def session_pids(session: int) -> set[int]:
    """Live processes of a session: the server and every worker it started."""
    return live_pids(session=session)


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def async_client(self):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait; returns the exit code. No process of the server may remain."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        deadline = time.monotonic() + 10
        while session_pids(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_pids(self.process.pid), "processes left behind after SIGTERM"
        return code

    def output(self) -> str:
        return self.log.read_text()


def start_server(tmp_path: Path, *args: str, env: dict | None = None, quiet: bool = True) -> Server:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    process = subprocess.Popen(
        [LLMCTL, *(["-q"] if quiet else []), "serve", *args, "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own session: the test finds every process it started
        env={**os.environ, **(env or {})},
    )
    server = Server(process, port, log)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.output()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{server.output()}")


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    started: list[Server] = []

    def factory(*args: str, env: dict | None = None, quiet: bool = True) -> Server:
        server = start_server(tmp_path_factory.mktemp("server"), *args, env=env, quiet=quiet)
        started.append(server)
        return server

    yield factory
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
