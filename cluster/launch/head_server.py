"""The model server of a cluster: `llmctl serve` inside the head container, on the Ray backend.

`llmctl serve -i cluster.yaml` starts it (`docker exec --detach`, its pid and log in the
container's /root/.llmctl), waits until /health answers, and records what it started in
`~/.llmctl/NAME-server.json` on the head node; `cluster status` reads that record and asks the
container (`python3 -m llmctl.cluster.launch.head_server probe PORT`) whether the server is alive
and healthy. The argv builders and the layout choice are pure; HeadServer does the I/O.

The API key: unless --no-api-key (or the inventory's env sets LLMCTL_API_KEY), `serve -i` makes
one, keeps it in `~/.llmctl/NAME-api.env` on the head node (mode 0600, reused by the next
`serve -i`) and hands it to the server as the cluster secret reaches the containers: `docker exec
--env-file`, so that it is on no command line, on the node or in the container.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields

from llmctl.cluster.errors import ClusterError, RemoteCommandError
from llmctl.cluster.inventory import Inventory
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.transport import Transport, check
from llmctl.cluster.plan.node_commands import Layout
from llmctl.cluster.plan.plan import RunStep

API_KEY_ENV = "LLMCTL_API_KEY"
STATE_DIR = "/root/.llmctl"  # inside the container
PID_FILE = f"{STATE_DIR}/server.pid"
LOG_FILE = f"{STATE_DIR}/server.log"
# Runs in the container: record the shell's pid, then become `llmctl serve` (same pid).
_LAUNCH = (
    'mkdir -p "$(dirname "$1")" && echo $$ > "$1" && log="$2" && shift 2 && exec "$@" >>"$log" 2>&1'
)


@dataclass(frozen=True)
class ServerRecord:
    """What `serve -i` started, kept on the head node."""

    model: str
    port: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    argv: tuple[str, ...]  # the head's (node 0's) `llmctl serve`
    backend: str = "ray"
    # mp: (host, argv) of nodes 1..N-1, in node-rank order (group_server.py)
    workers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # on the head node: the env file that gives the server LLMCTL_API_KEY; None: no key made
    api_key_file: str | None = None

    @classmethod
    def from_steps(
        cls, model: str, port: int, layout: Layout, steps: tuple[RunStep, ...], backend: str
    ) -> ServerRecord:
        """The record of what `steps` (cluster/plan/node_commands.serve_steps) start: node 0's
        argv, and every other node's with its host."""
        head, *workers = steps
        return cls(
            model, port, layout.tensor_parallel_size, layout.pipeline_parallel_size,
            head.argv, backend=backend, workers=tuple((s.host, s.argv) for s in workers),
        )  # fmt: skip

    @classmethod
    def from_json(cls, data: object) -> ServerRecord | None:
        """The record as any llmctl version wrote it (the head's ~/.llmctl is shared by every
        version run against it): the fields this one knows, unknown ones ignored, missing
        optional ones at their defaults; None (as if there were no record) when a field this
        version needs is missing or malformed."""
        if not isinstance(data, dict):
            return None
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        required = [f.name for f in fields(cls) if f.default is MISSING]
        if any(name not in known for name in required):
            return None
        try:
            known["port"] = int(known["port"])
            known["argv"] = tuple(str(arg) for arg in known["argv"])
            known["workers"] = tuple(
                (str(host), tuple(str(arg) for arg in argv))
                for host, argv in known.get("workers", ())
            )
        except (TypeError, ValueError):
            return None
        return cls(**known)

    def endpoint(self, head_ip: str) -> str:
        return f"http://{head_ip}:{self.port}/v1"


@dataclass(frozen=True)
class ServerState:
    """The server as the head container sees it."""

    running: bool
    health: int | None  # /health's status code; None when it does not answer
    pid: int | None = None
    restarts: int | None = None  # engine restarts (--restart-on-failure), from /health's body

    @property
    def label(self) -> str:
        if not self.running:
            return "stopped"
        if self.health == 200:
            return f"healthy, {self.restarts} engine restarts" if self.restarts else "healthy"
        return "starting" if self.health is None else f"unhealthy ({self.health})"


def launch_argv(
    container: str,
    argv: list[str],
    pid_file: str = PID_FILE,
    log_file: str = LOG_FILE,
    env_file: str | None = None,
) -> list[str]:
    """Detached in the container; its pid in `pid_file` and its output in `log_file`; with
    `env_file` (on the node), its variables too, which no command line then shows."""
    env = ["--env-file", env_file] if env_file else []
    return ["docker", "exec", "--detach", *env, container, "sh", "-c", _LAUNCH, "sh", pid_file,
            log_file, *argv]  # fmt: skip


def probe_argv(container: str, port: int) -> list[str]:
    return commands.docker_exec_argv(
        container, ["python3", "-m", "llmctl.cluster.launch.head_server", "probe", str(port)]
    )


def stop_argv(container: str) -> list[str]:
    return commands.docker_exec_argv(
        container, ["python3", "-m", "llmctl.cluster.launch.head_server", "stop"]
    )


def record_path(home: str, cluster: str) -> str:
    return f"{home}/.llmctl/{cluster}-server.json"


def api_key_path(home: str, cluster: str) -> str:
    return f"{home}/.llmctl/{cluster}-api.env"


def api_key_source(record: ServerRecord | None, inventory: Inventory) -> str:
    """Where the server's API key is, for `cluster status` and `serve -i`'s last line."""
    if record is not None and record.api_key_file:
        return (
            f"LLMCTL_API_KEY in {inventory.head.host}:{record.api_key_file} (mode 0600; clients "
            "send Authorization: Bearer KEY)"
        )
    if API_KEY_ENV in {**inventory.env, **inventory.head.env}:
        return f"{API_KEY_ENV} from {inventory.source}'s env"
    return "none (--no-api-key): anyone who reaches the port can use the model"


class HeadServer:
    """The server in one cluster's head container, reached through the head's transport."""

    def __init__(self, inventory: Inventory, transport: Transport, container: str) -> None:
        self.inventory = inventory
        self.transport = transport
        self.container = container
        self.head = inventory.head

    def record(self) -> ServerRecord | None:
        """What the last `serve -i` started; None when there is no record, or one this llmctl
        cannot read (unreadable_record() says which)."""
        return self._read_record()[1]

    def unreadable_record(self) -> str | None:
        """The path of a record that is there but that this llmctl cannot read (another
        version's, or damaged); None when there is none, or it reads."""
        there, record = self._read_record()
        return (
            record_path(self.transport.home(), self.inventory.name)
            if there and not record
            else None
        )

    def _read_record(self) -> tuple[bool, ServerRecord | None]:
        """(whether the record file is there, the record as this version reads it)."""
        path = record_path(self.transport.home(), self.inventory.name)
        try:
            with self.transport.open(path, "rb") as f:
                raw = f.read()
        except OSError:
            return False, None
        try:
            return True, ServerRecord.from_json(json.loads(raw.decode()))
        except ValueError:  # not JSON (UnicodeDecodeError is one)
            return True, None

    def state(self, port: int) -> ServerState:
        result = self.transport.run(probe_argv(self.container, port), timeout=30)
        if not result.ok:
            return ServerState(False, None)
        data = json.loads(result.stdout)
        return ServerState(data["running"], data["health"], data["pid"], data.get("restarts"))

    def start(
        self, record: ServerRecord, *, wait_s: float, log: Callable[[str], None]
    ) -> ServerState:
        current = self.record()
        if current is not None and self.state(current.port).running:
            if current == record:
                return self.wait_healthy(record, wait_s)
            log(f"stopping the server started with {' '.join(current.argv)}")
            self.stop()
        elif current is None:
            self.stop_unrecorded(log)
        home = self.transport.home()
        self.transport.makedirs(f"{home}/.llmctl")
        self.transport.write_file(
            record_path(home, self.inventory.name), json.dumps(asdict(record)).encode()
        )
        argv = launch_argv(self.container, list(record.argv), env_file=record.api_key_file)
        check(self.transport.run(argv), self.head.host, "docker exec (llmctl serve)")
        return self.wait_healthy(record, wait_s)

    def api_key_file(self) -> str | None:
        """The head node's API key env file, made (mode 0600) with a new key unless it exists;
        None when the inventory's env gives the key."""
        if API_KEY_ENV in {**self.inventory.env, **self.head.env}:
            return None
        home = self.transport.home()
        path = api_key_path(home, self.inventory.name)
        try:
            with self.transport.open(path, "rb") as f:
                if f.read().decode().startswith(f"{API_KEY_ENV}="):
                    return path
        except OSError:
            pass
        self.transport.makedirs(f"{home}/.llmctl")
        key = secrets.token_urlsafe(32)
        self.transport.write_file(path, f"{API_KEY_ENV}={key}\n".encode(), mode=0o600)
        return path

    def wait_healthy(self, record: ServerRecord, wait_s: float) -> ServerState:
        deadline = time.monotonic() + wait_s
        while True:
            state = self.state(record.port)
            if state.running and state.health == 200:
                return state
            if not state.running:
                raise ClusterError(
                    f"the server on {self.head.host} exited: {self.last_log_line()}",
                    f"see its log: llmctl cluster exec head -i {self.inventory.source} --"
                    f" tail -n 50 {LOG_FILE}",
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the server on {self.head.host} did not answer /health within"
                    f" {wait_s:.0f} s (last log line: {self.last_log_line()})",
                    f"it is still running: wait, or stop it with llmctl serve -i"
                    f" {self.inventory.source} --stop",
                )
            time.sleep(2.0)

    def last_log_line(self) -> str:
        result = self.transport.run(
            commands.docker_exec_argv(self.container, ["tail", "-n", "20", LOG_FILE])
        )
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        if len(lines) >= 2 and lines[-1].startswith("hint:"):  # a typed error: what, then how
            return f"{lines[-2]} ({lines[-1]})"
        return lines[-1] if lines else "(no output)"

    def stop_unrecorded(self, log: Callable[[str], None]) -> None:
        """Stop a server whose record this llmctl cannot read (another version started it): the
        new one would find its port taken, and the old one would lose its pid file."""
        path = self.unreadable_record()
        if path is not None and self.stop():
            log(f"stopped the running server: its record {path} is not one this llmctl reads")

    def stop(self) -> bool:
        """SIGTERM the server and wait for it to finish its requests; True if one ran."""
        result = self.transport.run(stop_argv(self.container), timeout=120)
        if result.returncode not in (0, 3):
            raise RemoteCommandError(
                f"{self.head.host}: stopping the server failed: {result.error_line()}",
                f"look at the container: llmctl cluster exec head -i {self.inventory.source}"
                f" -- cat {PID_FILE}",
            )
        return result.returncode == 0


# -- in the head container: `python3 -m llmctl.cluster.launch.head_server probe PORT | stop`
def _pid() -> int | None:
    try:
        pid = int(open(PID_FILE).read().strip())
    except (OSError, ValueError):
        return None
    return pid if os.path.exists(f"/proc/{pid}") else None


def _probe(port: int) -> dict:
    pid = _pid()
    health = restarts = None
    if pid is not None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                health = r.status
                restarts = json.loads(r.read() or b"{}").get("restarts")
        except urllib.error.HTTPError as exc:
            health = exc.code
        except (OSError, ValueError, AttributeError):
            pass
    return {"running": pid is not None, "health": health, "pid": pid, "restarts": restarts}


def _stop(wait_s: float = 90.0) -> int:
    import signal

    pid = _pid()
    if pid is None:
        return 3
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.5)
    if os.path.exists(f"/proc/{pid}"):
        os.kill(pid, signal.SIGKILL)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"] and len(argv) == 2:
        print(json.dumps(_probe(int(argv[1]))))
        return 0
    if argv == ["stop"]:
        return _stop()
    print("usage: python3 -m llmctl.cluster.launch.head_server probe PORT | stop", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
