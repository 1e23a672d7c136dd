"""`cluster up`'s act step: carry out up_diff's actions over one Transport per node, then check
that the nodes formed the planned cluster.

The head first (a worker's `ray start --address` needs it), then the head must be ready (Ray
answers; with the mp backend, llmctl answers in the container), then the workers in parallel.
A Keep does nothing. A failure names the nodes whose containers this run started (UpFailed
carries them), so the caller can say what runs where.
`verify_ray` waits until Ray on the head counts every node and GPU, and each node is registered
under its VLLM_HOST_IP. `verify_mp` (no Ray: nothing joins before `serve -i`) checks that every
container runs llmctl, and the same llmctl, torch and Python.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from llmctl.cluster.errors import ClusterError, RayClusterError
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.node_launch import NodeLaunch
from llmctl.cluster.launch.parsers import (
    ContainerState,
    RayNode,
    RayStatus,
    parse_ray_nodes,
    parse_ray_status,
)
from llmctl.cluster.launch.probe import inspect_container
from llmctl.cluster.launch.transport import CommandResult, Transport, check
from llmctl.cluster.launch.up_diff import Action, Keep, Remove

RAY_WAIT_S = 120.0  # how long Ray may take to start, and to count every node


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
        wait_ready(transports[head.launch.host], head.launch, ray_wait_s)
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


def remove(transport: Transport, action: Remove) -> None:
    """`cluster down` on one node: docker rm, then its env file (it holds the Ray token)."""
    check(transport.run(commands.docker_rm_argv(action.container)), action.host, "docker rm")
    if action.env_file:
        transport.run(["rm", "-f", "--", action.env_file])


def carry_out_removal(transport: Transport, action: Remove | None, dry_run: bool) -> str:
    """`cluster down` on one node: what its report row says (absent, would remove, removed)."""
    if action is None:
        return "absent"
    if dry_run:
        return f"would {action.verb}"
    remove(transport, action)
    return "removed"


def wait_ready(transport: Transport, launch: NodeLaunch, wait_s: float) -> None:
    """Until the node's container is ready: Ray answers (ray), or llmctl does (mp)."""
    if launch.backend == "ray":
        wait_for_ray(transport, launch, wait_s)
    else:
        container_versions(transport, launch, wait_s)


def container_versions(transport: Transport, launch: NodeLaunch, wait_s: float) -> dict:
    """The versions llmctl reports in the container (commands.VERSIONS_SCRIPT), once it answers;
    its exit, or no answer within `wait_s`, is an error."""
    deadline = time.monotonic() + wait_s
    while True:
        result = transport.run(commands.versions_argv(launch.container), timeout=60)
        if result.ok:
            return json.loads(result.stdout)
        state = inspect_container(transport, launch.container)
        if state is None or not state.running or time.monotonic() > deadline:
            raise ClusterError(
                f"the container on the {launch.role} {launch.host} is not ready:"
                f" {_why(transport, launch, state)}",
                f"see `llmctl cluster logs {launch.host}` (or docker logs {launch.container})",
            )
        time.sleep(0.5)


def verify_mp(
    transports: dict[str, Transport], launches: list[NodeLaunch], wait_s: float
) -> dict[str, dict]:
    """The mp backend's check after `up`: every container answers with llmctl installed, and
    all agree on llmctl, torch and Python (the ranks of one group load each other's pickles).
    Returns each host's versions."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(launches)))) as pool:
        futures = {
            launch.host: pool.submit(container_versions, transports[launch.host], launch, wait_s)
            for launch in launches
        }
        versions = {host: future.result() for host, future in futures.items()}
    for launch in launches:
        if not versions[launch.host].get("llmctl"):
            raise ClusterError(
                f"{launch.host}: the image {launch.image} has no llmctl",
                "build it with llmctl image build --no-ray and name it in the inventory's image",
            )
    for name in ("llmctl", "torch", "python"):
        seen = {host: v.get(name) for host, v in versions.items()}
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{host} {value}" for host, value in seen.items())
            raise ClusterError(
                f"the nodes' containers run different {name} versions: {listed}",
                "give every node the same image: `--image-file` loads a file only where its tag "
                "is missing, so load it under a new tag (cluster up --image NEW_TAG --image-file "
                "FILE), or build it on each node (llmctl image build)",
            )
    return versions


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


def verify_ray(
    transport: Transport, launches: list[NodeLaunch], wait_s: float
) -> tuple[RayStatus, dict[str, RayNode]]:
    """Ray's status on the head (`transport`), once it counts every launch's node and GPUs, and
    the Ray node of each launch, by host; RayClusterError names what is missing or wrong."""
    head = launches[0]
    want_nodes = len(launches)
    want_gpus = float(sum(launch.gpus or 0 for launch in launches))
    deadline = time.monotonic() + wait_s
    status = RayStatus((), (), {})
    while True:
        result = transport.run(commands.ray_status_argv(head.container), timeout=60)
        if result.ok:
            status = parse_ray_status(result.stdout)
            if len(status.active_nodes) >= want_nodes and status.gpus >= want_gpus:
                break
        if time.monotonic() > deadline:
            seen = {n.ip for n in ray_nodes(transport, head.container) if n.alive}
            missing = [launch.host for launch in launches if launch.ip not in seen]
            raise RayClusterError(
                f"after {wait_s:.0f} s Ray on {head.host} shows"
                f" {len(status.active_nodes)} of {want_nodes} nodes and {status.gpus:g} of"
                f" {want_gpus:g} GPUs; not joined: {', '.join(missing) or 'none'}",
                "see `llmctl cluster logs NODE` for those nodes",
            )
        time.sleep(1.0)
    by_ip = {n.ip: n for n in ray_nodes(transport, head.container) if n.alive}
    joined, wrong = {}, []
    for launch in launches:
        node = by_ip.get(launch.ip)
        if node is None:
            wrong.append(f"{launch.host} (VLLM_HOST_IP {launch.ip})")
            continue
        joined[launch.host] = node
        if launch.gpus is not None and node.gpus != launch.gpus:
            raise RayClusterError(
                f"{launch.host}: Ray sees {node.gpus:g} GPUs, the inventory declares {launch.gpus}",
                "fix `gpus:` for that node, or its NVIDIA runtime (docker info)",
            )
    if wrong:
        extra = sorted(ip for ip in by_ip if ip not in {launch.ip for launch in launches})
        raise RayClusterError(
            f"Ray's node IPs differ from VLLM_HOST_IP for {', '.join(wrong)}; Ray registered"
            f" {', '.join(extra) or 'no other address'} instead",
            "set each node's `ip:` to the address Ray should use (vLLM then fails with"
            " 'No available node types can fulfill resource request')",
        )
    return status, joined


def ray_nodes(transport: Transport, container: str) -> list[RayNode]:
    """`ray list nodes` in the container; [] when it cannot tell."""
    result = transport.run(commands.ray_list_nodes_argv(container))
    if not result.ok:
        return []
    try:
        return parse_ray_nodes(result.stdout)
    except ValueError:
        return []
