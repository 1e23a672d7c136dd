"""`cluster up`'s decision: the plan (one NodeLaunch per node, head first) against what the probe
observed (each node's container, or None), as one typed action per node. Pure: no transport.
`cluster down`'s is `removal`: a Remove for each node that has the container.

    launches = [head n1, worker n2, worker n3]; observed: n1 running with n1's config hash,
    n2 running with an older hash, n3 absent
    diff(...) == [Keep(n1, "running with the same config"),
                  Recreate(n2, "its config changed"), Create(n3, "no container")]

A head that is (re)created gets a new Ray cluster: every worker must then join it, so a worker
that would be kept is recreated too ("a new head").
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.cluster.launch import commands
from llmctl.cluster.launch.node_launch import NodeLaunch
from llmctl.cluster.launch.parsers import ContainerState


@dataclass(frozen=True)
class Keep:
    """The node's container runs with the plan's config: left alone."""

    launch: NodeLaunch
    reason: str
    verb = "unchanged"

    def argvs(self) -> list[list[str]]:
        return []


@dataclass(frozen=True)
class Create:
    """No container on the node: write its env file, docker run."""

    launch: NodeLaunch
    reason: str
    verb = "create"

    def argvs(self) -> list[list[str]]:
        return [self.launch.docker_run_argv()]


@dataclass(frozen=True)
class Recreate:
    """A container that differs from the plan (or stopped): docker rm, then as Create."""

    launch: NodeLaunch
    reason: str
    verb = "recreate"

    def argvs(self) -> list[list[str]]:
        return [commands.docker_rm_argv(self.launch.container), self.launch.docker_run_argv()]


@dataclass(frozen=True)
class Remove:
    """`cluster down`: a container of the cluster on the node goes (its env file with it)."""

    host: str
    container: str
    reason: str
    env_file: str | None = None
    verb = "remove"

    def argvs(self) -> list[list[str]]:
        return [commands.docker_rm_argv(self.container)]


Action = Keep | Create | Recreate


def removal(
    host: str, container: str, state: ContainerState | None, env_file: str | None = None
) -> Remove | None:
    """`cluster down` on one node: Remove its container, or None when there is none."""
    if state is None:
        return None
    return Remove(host, container, f"its container is {state.status}", env_file)


def node_action(launch: NodeLaunch, state: ContainerState | None) -> Action:
    """One node on its own: its container against its launch."""
    if state is None:
        return Create(launch, "no container")
    if not state.running:
        return Recreate(launch, f"its container is {state.status}")
    if state.labels.get(commands.LABEL_CONFIG) != launch.config_hash:
        return Recreate(launch, "its config changed")
    return Keep(launch, "running with the same config")


def diff(launches: list[NodeLaunch], observed: dict[str, ContainerState | None]) -> list[Action]:
    """One action per launch, in the plan's order (head first); `observed` by host."""
    actions = [node_action(launch, observed.get(launch.host)) for launch in launches]
    head = actions[0]
    if isinstance(head, Keep):
        return actions
    return [head] + [
        Recreate(a.launch, f"a new head on {head.launch.host}") if isinstance(a, Keep) else a
        for a in actions[1:]
    ]


def changes(actions: list[Action]) -> bool:
    return any(not isinstance(a, Keep) for a in actions)
