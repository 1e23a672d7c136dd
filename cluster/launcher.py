"""The cluster launcher: `cluster up/down/status/logs/exec` over one Transport per node.

`up` is probe -> compare -> act:
  1. refuse public VLLM_HOST_IPs (unless allowed), probe every node in parallel (read-only), and
     collect every problem (unreachable, SSH key, Docker, image, model, network); any problem
     stops here with nothing started;
  2. load the image file and copy the model where they are missing (when asked to);
  3. plan one NodeLaunch per node; a node whose running container carries the same config hash
     is left alone, any other is (re)created, and a new head means new workers;
  4. start the head, wait for Ray on it, start the workers in parallel;
  5. verify with `ray status` (nodes, GPUs) and `ray list nodes` (each node's IP is its
     VLLM_HOST_IP).
A failure after step 4 began names what is running and how to remove it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.cluster import commands
from llmctl.cluster.errors import (
    ClusterError,
    ConfigError,
    DockerUnavailableError,
    ImageMissingError,
    ModelMismatchError,
    NodeNetworkError,
    RayClusterError,
)
from llmctl.cluster.head_server import HeadServer, ServerRecord, ServerState
from llmctl.cluster.invariants import model_copies, own_address
from llmctl.cluster.inventory import Inventory, NodeSpec
from llmctl.cluster.node_launch import (
    FORWARDED_SECRETS,
    NodeFacts,
    NodeLaunch,
    container_name,
    env_file_path,
    local_container_name,
    local_launch,
    node_launches,
)
from llmctl.cluster.parsers import (
    RayNode,
    RayStatus,
    parse_ray_nodes,
    parse_ray_status,
)
from llmctl.cluster.preflight import probe_problems, public_ip_problems, raise_problems
from llmctl.cluster.probe import (
    NodeProbe,
    docker_problem,
    fingerprint,
    inspect_container,
    probe_node,
)
from llmctl.cluster.transfer import copy_model, load_image_file
from llmctl.cluster.transport import (
    CommandResult,
    LocalTransport,
    SSHTransport,
    Transport,
    check,
)
from llmctl.cluster.up_diff import Action, Keep, changes, diff, node_action
from llmctl.cluster.up_executor import UpFailed, execute, start, wait_for_ray

RAY_WAIT_S = 120.0


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


def ssh_transports(inventory: Inventory) -> dict[str, Transport]:
    ssh = inventory.ssh
    return {
        n.host: SSHTransport(n.host, user=ssh.user, port=ssh.port, key=ssh.key)
        for n in inventory.nodes
    }


class Cluster:
    """One inventory's cluster, reached through one transport per node."""

    def __init__(
        self,
        inventory: Inventory,
        transports: dict[str, Transport] | None = None,
        *,
        log: Callable[[str], None] = lambda line: None,
        ray_wait_s: float = RAY_WAIT_S,
    ) -> None:
        self.inventory = inventory
        self.transports = transports or ssh_transports(inventory)
        self.log = log
        self.ray_wait_s = ray_wait_s
        self.container = container_name(inventory.name)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _parallel(self, fn: Callable, nodes) -> dict:
        nodes = list(nodes)
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
            futures = {n.host: pool.submit(fn, n) for n in nodes}
            return {host: f.result() for host, f in futures.items()}

    # -- up ---------------------------------------------------------------------------------
    def up(
        self,
        *,
        image: str | None = None,
        image_file: str | None = None,
        sync_model: bool = False,
        allow_public_ip: bool = False,
        dry_run: bool = False,
    ) -> Report:
        """Probe -> preflight -> prepare (image, model) -> plan -> diff -> act -> verify."""
        image = self._check_request(image, image_file, allow_public_ip)
        probes = self._probe(image)
        raise_problems(probe_problems(self.inventory, probes, image=image,
                                      image_file=image_file, sync_model=sync_model))  # fmt: skip
        report = Report(self.inventory.name, [], dry_run=dry_run)
        self._load_images(probes, image, image_file, report)
        self._sync_model(probes, sync_model, report)
        launches = self._plan(probes, image)
        actions = diff(launches, {host: probe.container for host, probe in probes.items()})
        _describe(actions, report)
        if dry_run:
            return report
        self._act(actions, report)
        return report

    def _check_request(
        self, image: str | None, image_file: str | None, allow_public_ip: bool
    ) -> str:
        """The image to run; refuses public VLLM_HOST_IPs (unless allowed) and a missing file."""
        inv = self.inventory
        raise_problems(public_ip_problems(inv, allow_public_ip))
        image = image or inv.image
        if not image:
            raise ConfigError(
                f"{inv.source} names no container image", "add `image: llmctl:latest`"
            )
        if image_file and not Path(image_file).expanduser().is_file():
            raise ConfigError(
                f"--image-file {image_file} does not exist",
                f"make it with docker save {image} -o FILE",
            )
        return image

    def _probe(self, image: str) -> dict[str, NodeProbe]:
        """Every node, in parallel, read-only."""
        self.log(f"probing {len(self.inventory.nodes)} nodes")
        return self._parallel(
            lambda n: probe_node(
                self.transports[n.host], image, self.inventory.model, self.container
            ),  # fmt: skip
            self.inventory.nodes,
        )

    def _act(self, actions: list[Action], report: Report) -> None:
        """Carry out the actions, then verify Ray; a failure says what runs where."""
        source = self.inventory.source
        try:
            execute(actions, self.transports, ray_wait_s=self.ray_wait_s, log=self.log)
            report.ray = self._verify([a.launch for a in actions], report)
        except UpFailed as failed:
            exc, running = failed.error, ", ".join(failed.started) or "none"
        except ClusterError as exc_:
            exc = exc_
            running = ", ".join(a.launch.host for a in actions if not isinstance(a, Keep))
        else:
            for row in report.rows:
                row.action = _DONE.get(row.action, row.action)
            return
        raise type(exc)(
            exc.message,
            f"{exc.hint + '; ' if exc.hint else ''}containers started by this run: {running};"
            f" `llmctl cluster status -i {source}` shows the cluster,"
            f" `llmctl cluster down -i {source}` removes it",
        ) from None

    def _load_images(
        self, probes: dict[str, NodeProbe], image: str, image_file: str | None, report: Report
    ) -> None:
        lacking = [n for n in self.inventory.nodes if probes[n.host].image_id is None]
        if not lacking or not image_file:
            return
        path = str(Path(image_file).expanduser())
        if report.dry_run:
            for node in lacking:
                report.commands.setdefault(node.host, []).append(
                    ["(upload)", path, "&&", *commands.docker_load_argv(path)]
                )
                probes[node.host].image_id = "(loaded from --image-file)"
            return
        self.log(f"loading {path} on {', '.join(n.host for n in lacking)}")

        def load(node: NodeSpec) -> None:
            transport = self.transports[node.host]
            load_image_file(transport, path)
            found = transport.run(commands.image_id_argv(image))
            if not found.ok:
                raise ImageMissingError(
                    f"{node.host}: {path} was loaded but holds no image {image}",
                    f"make the file with docker save {image} -o FILE",
                )
            probes[node.host].image_id = found.stdout.strip()

        self._parallel(load, lacking)
        report.notes.append(f"loaded {os.path.basename(path)} on {len(lacking)} node(s)")

    def _sync_model(self, probes: dict[str, NodeProbe], sync_model: bool, report: Report) -> None:
        model = self.inventory.model
        if not model or not sync_model:
            return
        lacking = [n for n in self.inventory.nodes if probes[n.host].model_files is None]
        if not lacking:
            return
        nodes = self.inventory.nodes
        head = next(i for i, n in enumerate(nodes) if n.head)
        copies = model_copies([probes[n.host].model_fingerprint for n in nodes], head)
        source = nodes[copies[0].reference or 0]  # the copy the others must equal
        files = probes[source.host].model_files or {}
        if report.dry_run:
            for node in lacking:
                report.commands.setdefault(node.host, []).append(
                    ["(copy)", f"{source.host}:{model}", model]
                )
            return
        size = sum(files.values()) / 2**20
        self.log(f"copying the model ({size:.0f} MiB) from {source.host} to "
                 f"{', '.join(n.host for n in lacking)}")  # fmt: skip

        def copy(node: NodeSpec) -> None:
            target = self.transports[node.host]
            copy_model(self.transports[source.host], target, model, files)
            got_files, got = fingerprint(target, model)
            probes[node.host].model_files, probes[node.host].model_fingerprint = got_files, got
            if got != probes[source.host].model_fingerprint:
                raise ModelMismatchError(
                    f"{node.host}: the copied model differs from {source.host}'s",
                    "check the disk space on the node and run again",
                )

        self._parallel(copy, lacking)
        report.notes.append(f"copied the model to {', '.join(n.host for n in lacking)}")

    def _plan(self, probes: dict[str, NodeProbe], image: str) -> list[NodeLaunch]:
        inv = self.inventory
        facts = {}
        for node in inv.nodes:
            probe = probes[node.host]
            own = own_address(node.ip, probe.addresses)
            facts[node.host] = NodeFacts(
                ifname=own.ifname if own else None,
                image_id=probe.image_id,
                nvidia_runtime=bool(probe.docker and probe.docker.nvidia),
                home=probe.home,
                hostname=probe.hostname,
            )
        head_probe = probes[inv.head.host]
        token = None
        if head_probe.container is not None:
            path = env_file_path(head_probe.home, inv.name, inv.head.ip)
            token = self._read_env(inv.head, path).get("RAY_AUTH_TOKEN")
        # Ray's token authentication: only holders of the token can use the cluster's ports.
        extra = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token or secrets.token_hex(32)}
        for name in FORWARDED_SECRETS:
            if os.environ.get(name):
                extra[name] = os.environ[name]
        return node_launches(inv, facts, secrets=extra, image=image)

    def _read_env(self, node: NodeSpec, path: str) -> dict[str, str]:
        try:
            with self.transports[node.host].open(path, "rb") as f:
                text = f.read().decode()
        except OSError:
            return {}
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def _verify(self, launches: list[NodeLaunch], report: Report) -> RayStatus:
        head = launches[0]
        transport = self.transports[head.host]
        want_nodes = len(launches)
        want_gpus = float(sum(launch.gpus or 0 for launch in launches))
        deadline = time.monotonic() + self.ray_wait_s
        status = RayStatus((), (), {})
        while True:
            result = transport.run(commands.ray_status_argv(head.container), timeout=60)
            if result.ok:
                status = parse_ray_status(result.stdout)
                if len(status.active_nodes) >= want_nodes and status.gpus >= want_gpus:
                    break
            if time.monotonic() > deadline:
                nodes = self._ray_nodes(head.host)
                seen = {n.ip for n in nodes if n.alive}
                missing = [launch.host for launch in launches if launch.ip not in seen]
                raise RayClusterError(
                    f"after {self.ray_wait_s:.0f} s Ray on {head.host} shows"
                    f" {len(status.active_nodes)} of {want_nodes} nodes and {status.gpus:g} of"
                    f" {want_gpus:g} GPUs; not joined: {', '.join(missing) or 'none'}",
                    "see `llmctl cluster logs NODE` for those nodes",
                )
            time.sleep(1.0)
        nodes = self._ray_nodes(head.host)
        by_ip = {n.ip: n for n in nodes if n.alive}
        wrong = []
        for launch, row in zip(launches, report.rows, strict=True):
            node = by_ip.get(launch.ip)
            if node is None:
                wrong.append(f"{launch.host} (VLLM_HOST_IP {launch.ip})")
                continue
            row.ray_ip, row.gpus = node.ip, node.gpus
            if launch.gpus is not None and node.gpus != launch.gpus:
                raise RayClusterError(
                    f"{launch.host}: Ray sees {node.gpus:g} GPUs, the inventory declares"
                    f" {launch.gpus}",
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
        return status

    def _ray_nodes(self, head_host: str) -> list[RayNode]:
        result = self.transports[head_host].run(commands.ray_list_nodes_argv(self.container))
        if not result.ok:
            return []
        try:
            return parse_ray_nodes(result.stdout)
        except ValueError:
            return []

    # -- down, status, logs, exec -------------------------------------------------------------
    def down(self, *, dry_run: bool = False) -> Report:
        report = Report(self.inventory.name, [], dry_run=dry_run)

        def remove(node: NodeSpec) -> NodeRow:
            row = NodeRow(node.host, "head" if node.head else "worker", node.ip)
            row.container = self.container
            transport = self.transports[node.host]
            try:
                state = inspect_container(transport, self.container)
                if state is None:
                    row.action = "absent"
                    return row
                if dry_run:
                    row.action = "would remove"
                    return row
                check(
                    transport.run(commands.docker_rm_argv(self.container)), node.host, "docker rm"
                )
                transport.run(
                    [
                        "rm",
                        "-f",
                        "--",
                        env_file_path(transport.home(), self.inventory.name, node.ip),
                    ]
                )
                row.action = "removed"
            except ClusterError as exc:
                row.action, row.error = "failed", exc.message
            return row

        for node in self.inventory.nodes:
            report.commands[node.host] = [commands.docker_rm_argv(self.container)]
        rows = self._parallel(remove, self.inventory.nodes)
        report.rows = [rows[n.host] for n in self.inventory.nodes]
        report.changed = any(r.action == "removed" for r in report.rows)
        return report

    def status(self) -> Report:
        report = Report(self.inventory.name, [])

        def look(node: NodeSpec) -> NodeRow:
            row = NodeRow(node.host, "head" if node.head else "worker", node.ip)
            row.container = self.container
            transport = self.transports[node.host]
            try:
                state = inspect_container(transport, self.container)
                if state is None:
                    row.status = "absent"
                    return row
                row.status = state.status
                if state.running:
                    result = transport.run(commands.versions_argv(self.container))
                    if result.ok:
                        row.versions = json.loads(result.stdout)
            except ClusterError as exc:
                row.status, row.error = "unreachable", exc.message
            return row

        rows = self._parallel(look, self.inventory.nodes)
        report.rows = [rows[n.host] for n in self.inventory.nodes]
        head_row = rows[self.inventory.head.host]
        if head_row.status == "running":
            by_ip = {n.ip: n for n in self._ray_nodes(self.inventory.head.host) if n.alive}
            for row in report.rows:
                node = by_ip.get(row.ip)
                row.ray_ip = node.ip if node else None
                row.gpus = node.gpus if node else None
            result = self.transports[self.inventory.head.host].run(
                commands.ray_status_argv(self.container)
            )
            if result.ok:
                report.ray = parse_ray_status(result.stdout)
            server = HeadServer(self.inventory, self.transports[self.inventory.head.host],
                                self.container)  # fmt: skip
            record = server.record()
            if record is not None:
                report.server = (record, server.state(record.port))
        return report

    def node(self, name: str) -> NodeSpec:
        """A node by its host, its ip, or `head`."""
        for node in self.inventory.nodes:
            if name in (node.host, node.ip) or (name == "head" and node.head):
                return node
        known = ", ".join(n.host for n in self.inventory.nodes)
        raise ConfigError(
            f"no node {name!r} in {self.inventory.source}", f"use one of: {known}, head"
        )

    def logs(self, name: str, tail: int | None = None) -> CommandResult:
        node = self.node(name)
        return self.transports[node.host].run(commands.docker_logs_argv(self.container, tail))

    def exec(self, name: str, argv: list[str], timeout: float = 600.0) -> CommandResult:
        node = self.node(name)
        transport = self.transports[node.host]
        if inspect_container(transport, self.container) is None:
            raise ClusterError(
                f"{node.host} has no container {self.container}",
                f"start the cluster: llmctl cluster up -i {self.inventory.source}",
            )
        return transport.run(commands.docker_exec_argv(self.container, argv), timeout=timeout)


def up_local(
    transport: Transport, launch: NodeLaunch, *, dry_run: bool = False, wait_s: float = RAY_WAIT_S
) -> Report:
    """`cluster up --head/--worker`: this node's container, detached, under a stable name."""
    report = Report(launch.cluster, [], dry_run=dry_run)
    action = node_action(launch, inspect_container(transport, launch.container))
    _describe([action], report)
    if not dry_run and not isinstance(action, Keep):
        start(transport, launch)
        report.rows[0].action = _DONE[action.verb]
    if not dry_run:
        wait_for_ray(transport, launch, wait_s)
    return report


def up_this_node(
    role: str,
    *,
    ip: str | None,
    head_ip: str | None,
    image: str | None,
    hf_home: str | None = None,
    gpus: int | None = None,
    env: dict[str, str] | None = None,
    dry_run: bool = False,
    transport: Transport | None = None,
) -> Report:
    """Probe this node, build its NodeLaunch, and bring its container up."""
    if not ip:
        raise ConfigError("this node's IP is not known", "pass --ip or set VLLM_HOST_IP")
    if role == "worker" and not head_ip:
        raise ConfigError("--worker needs the head's address", "pass --head-ip HEAD_IP")
    if not image:
        raise ConfigError("no image given", "pass --image llmctl:latest (see llmctl image build)")
    transport = transport or LocalTransport()
    probe = probe_node(transport, image, None, local_container_name(role))
    if probe.docker is None:
        cause = docker_problem(probe.docker_error) if probe.docker_error else "no Docker"
        raise DockerUnavailableError(f"{cause} on this node", "install docker and start dockerd")
    if probe.image_id is None:
        raise ImageMissingError(
            f"the image {image} is not on this node", "build it: llmctl image build --tag " + image
        )
    own = own_address(ip, probe.addresses)
    if own is None:
        have = ", ".join(a.ip for a in probe.addresses if not a.interface.is_loopback)
        raise NodeNetworkError(
            f"{ip} is not an address of this node (it has {have})", "pass --ip with one of its own"
        )
    facts = NodeFacts(
        own.ifname, probe.image_id, bool(probe.docker.nvidia), probe.home, probe.hostname
    )
    launch = local_launch(
        role, ip, head_ip or ip, image, facts, hf_home=hf_home, gpus=gpus, env=env
    )
    return up_local(transport, launch, dry_run=dry_run)


def down_local(transport: Transport, *, dry_run: bool = False) -> Report:
    """Remove this node's `cluster up --head/--worker` containers."""
    report = Report("local", [], dry_run=dry_run)
    for role in ("head", "worker"):
        name = local_container_name(role)
        row = NodeRow(transport.name, role, "", container=name)
        report.commands[transport.name] = report.commands.get(transport.name, []) + [
            commands.docker_rm_argv(name)
        ]
        if inspect_container(transport, name) is None:
            row.action = "absent"
        elif dry_run:
            row.action = "would remove"
        else:
            check(transport.run(commands.docker_rm_argv(name)), transport.name, "docker rm")
            row.action = "removed"
            report.changed = True
        report.rows.append(row)
    return report


_DONE = {"create": "created", "recreate": "recreated"}


def _describe(actions: list[Action], report: Report) -> None:
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
