"""The model server of an mp cluster (`cluster up --backend mp`): `llmctl serve` in every node's
container, one mp group across the nodes, no Ray.

`llmctl serve -i cluster.yaml --backend mp` starts, in node-rank order (the head is node 0, then
the inventory's other nodes), what a user would type on each node:

    node 0    llmctl serve MODEL -tp T -pp P --distributed-executor-backend mp --nnodes N
              --master-addr HEAD_IP --master-port 29501 --node-rank 0 --host 0.0.0.0 --port 8000
    node r    llmctl serve MODEL ... --nnodes N --master-addr HEAD_IP --master-port 29501
              --node-rank r --headless

Each node runs whole pipeline stages (engine/distributed/ranks.py): T ranks per stage, P/N
stages per node, so P must be a multiple of N; the usual layout is T = GPUs per node, P = N.
Workers start first (they wait up to --rendezvous-timeout for node 0), then node 0; each process
is recorded as the head's is (pid and log in the container's /root/.llmctl), and the head's
record (`~/.llmctl/NAME-server.json`) lists every node's argv. Stopping SIGTERMs node 0, which
ends the group on every node; a node still running after that is stopped too.

The argv builder and the layout check are pure; GroupServer does the I/O, over the same
transports and `docker exec` launch as HeadServer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from llmctl.cluster.errors import ClusterError, ConfigError, RemoteCommandError
from llmctl.cluster.inventory import Inventory
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.commands import BACKENDS
from llmctl.cluster.launch.head_server import (
    LOG_FILE,
    HeadServer,
    ServerRecord,
    ServerState,
    launch_argv,
    record_path,
    stop_argv,
)
from llmctl.cluster.launch.transport import Transport, check
from llmctl.cluster.plan.node_commands import MASTER_PORT, Layout, serve_steps


def check_cluster_backend(
    backend: str | None, running_on: str, source: str, *, stop: bool = False
) -> str:
    """The backend `serve -i` uses: the one asked for, which must be the containers' own
    (`running_on`, their label), else theirs. `--stop` stops whatever runs."""
    if backend is None or stop:
        return running_on
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)}")
    if backend != running_on:
        raise ConfigError(
            f"the cluster's containers were started for the {running_on} backend, not {backend}",
            f"run llmctl cluster up -i {source} --backend {backend} first, or drop --backend",
        )
    return backend


def group_record(
    model: str,
    layout: Layout,
    port: int,
    options: Mapping[str, object],
    server: Mapping[str, object] | None,
    inventory: Inventory,
    master_port: int = MASTER_PORT,
) -> ServerRecord:
    """What `serve -i --backend mp` starts on every node, as the head's record keeps it."""
    steps = serve_steps(model, layout, port, options, server, inventory, "mp", master_port)
    return ServerRecord.from_steps(model, port, layout, steps, "mp")


def exit_reason(log: str) -> str:
    """Why a node's `llmctl serve` exited, from its log's tail: its last `error:` line (the
    CLI prints the error, then its hint), else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1].removeprefix("error:").strip()
    return lines[-1] if lines else "(no output)"


class GroupServer(HeadServer):
    """The mp group's processes, one per node's container; the head's record describes them."""

    def __init__(
        self, inventory: Inventory, transports: dict[str, Transport], container: str
    ) -> None:
        super().__init__(inventory, transports[inventory.head.host], container)
        self.transports = transports

    def _parallel(self, fn: Callable[[str], object], hosts: list[str]) -> dict[str, object]:
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
            futures = {host: pool.submit(fn, host) for host in hosts}
            return {host: future.result() for host, future in futures.items()}

    def _other_hosts(self) -> list[str]:
        """Every node but the head (node 0)."""
        return [node.host for node in self.inventory.nodes if node.host != self.head.host]

    def node_state(self, host: str, port: int) -> ServerState:
        """The process on `host` (the API's /health only answers on the head)."""
        return HeadServer(self.inventory, self.transports[host], self.container).state(port)

    def node_states(self, record: ServerRecord) -> dict[str, ServerState]:
        """Each node's process, by host, the head first."""
        hosts = [self.head.host] + [host for host, _ in record.workers]
        return self._parallel(lambda host: self.node_state(host, record.port), hosts)

    def start(
        self, record: ServerRecord, *, wait_s: float, log: Callable[[str], None]
    ) -> ServerState:
        current = self.record()
        if current is not None and current.backend == "mp":
            states = self.node_states(current)
            if current == record and all(state.running for state in states.values()):
                return self.wait_healthy(record, wait_s)
            if any(state.running for state in states.values()):
                log(f"stopping the server started with {' '.join(current.argv)}")
                self.stop()
        elif current is None:
            self.stop_unrecorded(log)
        home = self.transport.home()
        self.transport.makedirs(f"{home}/.llmctl")
        self.transport.write_file(
            record_path(home, self.inventory.name), json.dumps(asdict(record)).encode()
        )
        # The workers first: each waits for node 0 (--rendezvous-timeout), as on real hosts.
        self._parallel(lambda host: self._launch(host, dict(record.workers)[host]),
                       [host for host, _ in record.workers])  # fmt: skip
        self._launch(self.head.host, record.argv, record.api_key_file)  # node 0 serves the API
        return self.wait_healthy(record, wait_s)

    def _launch(self, host: str, argv: tuple[str, ...], env_file: str | None = None) -> None:
        result = self.transports[host].run(
            launch_argv(self.container, list(argv), env_file=env_file)
        )
        check(result, host, "docker exec (llmctl serve)")

    def wait_healthy(self, record: ServerRecord, wait_s: float) -> ServerState:
        """Until node 0's /health answers 200; a node whose process exits first is named."""
        deadline = time.monotonic() + wait_s
        while True:
            states = self.node_states(record)
            head = states[self.head.host]
            if head.running and head.health == 200:
                return head
            exited = [host for host, state in states.items() if not state.running]
            if exited:
                # Every node that exited, each with its error: the first to fail is not known.
                raise ClusterError(
                    "; ".join(
                        f"the server on {host} (node {list(states).index(host)}) exited:"
                        f" {self.node_log_line(host)}"
                        for host in exited
                    ),
                    f"see its log: llmctl cluster exec {exited[0]} -i {self.inventory.source}"
                    f" -- tail -n 50 {LOG_FILE}; stop the others with llmctl serve -i"
                    f" {self.inventory.source} --stop",
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the server on {self.head.host} did not answer /health within"
                    f" {wait_s:.0f} s (last log line: {self.last_log_line()})",
                    f"it is still running: wait, or stop it with llmctl serve -i"
                    f" {self.inventory.source} --stop",
                )
            time.sleep(2.0)

    def node_log_line(self, host: str) -> str:
        result = self.transports[host].run(
            commands.docker_exec_argv(self.container, ["tail", "-n", "20", LOG_FILE])
        )
        return exit_reason(result.stdout)

    def stop(self) -> bool:
        """SIGTERM node 0 (it ends the group on every node), then any node still running;
        True if a process ran anywhere."""
        there, record = self._read_record()
        unreadable = there and record is None  # another version's: its workers unknown, all
        stopped = super().stop()
        if not unreadable and (record is None or record.backend != "mp"):
            return stopped
        workers = [host for host, _ in record.workers] if record else self._other_hosts()

        def stop_node(host: str) -> bool:
            result = self.transports[host].run(stop_argv(self.container), timeout=120)
            if result.returncode not in (0, 3):
                raise RemoteCommandError(
                    f"{host}: stopping the server failed: {result.error_line()}",
                    f"look at the container: llmctl cluster exec {host} -i"
                    f" {self.inventory.source} -- ps -ef",
                )
            return result.returncode == 0

        others = self._parallel(stop_node, workers)
        return stopped or any(others.values())
