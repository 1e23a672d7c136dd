"""What `cluster up/down/status` report: one NodeRow per node, the commands per node (what
--dry-run prints), the env files with secrets masked, and Ray's status."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.cluster.launch.head_server import ServerRecord, ServerState
from llmctl.cluster.launch.parsers import RayStatus
from llmctl.cluster.launch.up_diff import Action, Keep, changes


@dataclass
class NodeRow:
    host: str
    role: str
    ip: str
    ifname: str | None = None
    container: str = ""
    action: str = ""  # created, recreated, unchanged, removed, absent, would create, ...
    ray_ip: str | None = None  # the IP Ray registered the node under
    gpus: float | None = None
    status: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Report:
    cluster: str
    rows: list[NodeRow]
    changed: bool = False
    dry_run: bool = False
    commands: dict[str, list[list[str]]] = field(default_factory=dict)  # per host, in order
    env: dict[str, dict[str, str]] = field(default_factory=dict)  # per host, secrets masked
    ray: RayStatus | None = None
    notes: list[str] = field(default_factory=list)
    server: tuple[ServerRecord, ServerState] | None = None  # `serve -i`'s server on the head
    backend: str = "ray"  # the containers' (ray, or mp: no Ray)
    # mp: `serve -i`'s process on each node (node 0's is `server`'s state), by host
    server_nodes: dict[str, ServerState] = field(default_factory=dict)
    joins: str | None = None  # status: whether the nodes prove one cluster secret when they join
    api_key: str | None = None  # status: where the server's API key is
    # status: the server record this llmctl cannot read (another version's), and what to do
    server_note: str | None = None


DONE = {"create": "created", "recreate": "recreated"}


def describe(actions: list[Action], report: Report) -> None:
    """The report's rows, env files and (for --dry-run) commands: one per action, in order."""
    for action in actions:
        launch = action.launch
        report.rows.append(
            NodeRow(
                launch.host, launch.role, launch.ip,
                ifname=dict(launch.env).get("NCCL_SOCKET_IFNAME"),
                container=launch.container,
                action=action.verb if not report.dry_run or isinstance(action, Keep)
                else f"would {action.verb}",
            )
        )  # fmt: skip
        report.env[launch.host] = launch.printable_env()
        if action.argvs():
            report.commands.setdefault(launch.host, []).extend(action.argvs())
    report.changed = changes(actions)
