"""`cluster up`'s act step: carry out up_diff's actions over one Transport per node.

The head first (a worker's `ray start --address` needs it), then Ray on the head must answer,
then the workers in parallel. A Keep does nothing. A failure names the nodes whose containers
this run started (UpFailed carries them), so the caller can say what runs where.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from llmctl.cluster import commands
from llmctl.cluster.errors import ClusterError, RayClusterError
from llmctl.cluster.node_launch import NodeLaunch
from llmctl.cluster.parsers import ContainerState
from llmctl.cluster.probe import inspect_container
from llmctl.cluster.transport import CommandResult, Transport, check
from llmctl.cluster.up_diff import Action, Keep


class UpFailed(Exception):
    """An action failed after others ran: the error, and the hosts this run started."""

    def __init__(self, error: ClusterError, started: list[str]) -> None:
        super().__init__(error.message)
        self.error, self.started = error, started


def execute(
    actions: list[Action],
    transports: dict[str, Transport],
    *,
    ray_wait_s: float,
    log: Callable[[str], None] = lambda line: None,
) -> list[str]:
    """Run the actions (head first); the hosts whose containers were (re)started."""
    started: list[str] = []
    head, workers = actions[0], [a for a in actions[1:] if not isinstance(a, Keep)]
    try:
        if not isinstance(head, Keep):
            log(f"starting the head on {head.launch.host}")
            start(transports[head.launch.host], head.launch)
            started.append(head.launch.host)
        wait_for_ray(transports[head.launch.host], head.launch, ray_wait_s)
        if workers:
            log(f"starting {len(workers)} workers")
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(workers)))) as pool:
            futures = [pool.submit(start, transports[a.launch.host], a.launch) for a in workers]
            errors = []
            for action, future in zip(workers, futures, strict=True):
                try:
                    future.result()
                    started.append(action.launch.host)
                except ClusterError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
    except ClusterError as exc:
        raise UpFailed(exc, started) from None
    return started


def start(transport: Transport, launch: NodeLaunch) -> None:
    """(Re)create the node's container: remove the old one, write the env file, docker run."""
    transport.run(commands.docker_rm_argv(launch.container))
    transport.write_file(launch.env_file, launch.env_file_text().encode(), mode=0o600)
    check(transport.run(launch.docker_run_argv()), launch.host, "docker run")


def wait_for_ray(transport: Transport, launch: NodeLaunch, wait_s: float) -> None:
    """Until `ray status` answers inside the container; its exit or the timeout is an error."""
    deadline = time.monotonic() + wait_s
    while True:
        result = transport.run(commands.ray_status_argv(launch.container), timeout=60)
        if result.ok:
            return
        state = inspect_container(transport, launch.container)
        if state is None or not state.running or time.monotonic() > deadline:
            raise RayClusterError(
                f"Ray did not start on the {launch.role} {launch.host}:"
                f" {_why(transport, launch, state)}",
                f"see `llmctl cluster logs {launch.host}` (or docker logs {launch.container})",
            )
        time.sleep(1.0)


def _why(transport: Transport, launch: NodeLaunch, state: ContainerState | None) -> str:
    if state is None:
        return "its container is gone"
    logs = transport.run(commands.docker_logs_argv(launch.container, tail=20))
    last = CommandResult((), 1, "", logs.stderr + logs.stdout).error_line()
    where = f"container {state.status}"
    if not state.running:
        where += f" (exit code {state.exit_code})"
    return f"{where}; last log line: {last}"
