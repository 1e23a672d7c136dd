"""The cluster launcher: `cluster up/down/status/logs/exec` over one Transport per node.

`up` is probe -> diff -> act:
  1. refuse public VLLM_HOST_IPs (unless allowed), probe every node in parallel (read-only,
     probe.py), and collect every problem (unreachable, SSH key, Docker, image, model, network;
     preflight.py); any problem stops here with nothing started;
  2. load the image file and copy the model where they are missing (when asked to);
  3. plan one NodeLaunch per node (node_launch.py) and diff it with the containers found
     (up_diff.py, pure): Keep a node whose running container carries the same config hash,
     (re)create any other, and a new head means new workers; --dry-run stops here;
  4. act (up_executor.py): start the head, wait for Ray on it, start the workers in parallel;
  5. verify with `ray status` (nodes, GPUs) and `ray list nodes` (each node's IP is its
     VLLM_HOST_IP).
With `backend="mp"` (no Ray) the containers idle with the model and the env (VLLM_HOST_IP, the
NCCL/Gloo interfaces) until `llmctl serve -i --backend mp` starts each node's part of the mp
group in them (group_server.py); steps 4-5 wait until llmctl answers in every container and check
that all run the same versions.
A failure after step 4 began names what is running and how to remove it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmctl.cluster.errors import (
    ClusterError,
    ConfigError,
    ImageMissingError,
    ModelMismatchError,
)
from llmctl.cluster.inventory import Inventory, NodeSpec
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.group_server import GroupServer
from llmctl.cluster.launch.head_server import HeadServer, api_key_source
from llmctl.cluster.launch.image_file import read_image_file
from llmctl.cluster.launch.invariants import model_copies, own_address
from llmctl.cluster.launch.launch_report import DONE, NodeRow, Report, describe
from llmctl.cluster.launch.node_launch import (
    FORWARDED_SECRETS,
    NodeFacts,
    NodeLaunch,
    container_name,
    env_file_path,
    node_launches,
)
from llmctl.cluster.launch.parsers import (
    RayNode,
    parse_ray_status,
)
from llmctl.cluster.launch.preflight import probe_problems, public_ip_problems, raise_problems
from llmctl.cluster.launch.probe import (
    NodeProbe,
    fingerprint,
    inspect_container,
    probe_node,
)
from llmctl.cluster.launch.transfer import copy_model, load_image_file
from llmctl.cluster.launch.transport import (
    CommandResult,
    SSHTransport,
    Transport,
)
from llmctl.cluster.launch.up_diff import Action, Keep, diff, removal
from llmctl.cluster.launch.up_executor import (
    RAY_WAIT_S,
    UpFailed,
    carry_out_removal,
    execute,
    ray_nodes,
    verify_mp,
    verify_ray,
)
from llmctl.engine.distributed.join import SECRET_ENV as CLUSTER_SECRET_ENV
from llmctl.engine.distributed.join import make_secret

_NOT_THERE = ("", "absent", "unreachable")  # a node's status without a container to ask


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
        backend: str = "ray",
    ) -> Report:
        """Probe -> preflight -> prepare (image, model) -> plan -> diff -> act -> verify; on
        the `backend` (ray, or mp: no Ray)."""
        image = self._check_request(image, image_file, allow_public_ip)
        probes = self._probe(image)
        raise_problems(probe_problems(self.inventory, probes, image=image,
                                      image_file=image_file, sync_model=sync_model))  # fmt: skip
        report = Report(self.inventory.name, [], dry_run=dry_run, backend=backend)
        self._load_images(probes, image, image_file, report)
        self._sync_model(probes, sync_model, report)
        launches = self._plan(probes, image, backend)
        actions = diff(launches, {host: probe.container for host, probe in probes.items()})
        describe(actions, report)
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
        """Carry out the actions, then verify the cluster; a failure says what runs where."""
        source = self.inventory.source
        launches = [a.launch for a in actions]
        try:
            execute(actions, self.transports, ray_wait_s=self.ray_wait_s, log=self.log)
            if report.backend == "mp":
                versions = verify_mp(self.transports, launches, self.ray_wait_s)
                for row in report.rows:
                    row.versions = versions[row.host]
                report.notes.append(f"serve a model: llmctl serve -i {source} --backend mp")
            else:
                head = self.transports[actions[0].launch.host]
                report.ray, joined = verify_ray(head, launches, self.ray_wait_s)
                for row in report.rows:
                    row.ray_ip, row.gpus = joined[row.host].ip, joined[row.host].gpus
        except UpFailed as failed:
            exc, running = failed.error, ", ".join(failed.started) or "none"
        except ClusterError as exc_:
            exc = exc_
            running = ", ".join(a.launch.host for a in actions if not isinstance(a, Keep))
        else:
            for row in report.rows:
                row.action = DONE.get(row.action, row.action)
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
        saved = read_image_file(path, image)
        short_id = saved.image_id.removeprefix("sha256:")[:12]
        self.log(f"loading {path} (image {short_id}) on {', '.join(n.host for n in lacking)}")

        def load(node: NodeSpec) -> str:
            transport = self.transports[node.host]
            shipped = load_image_file(transport, saved)
            found = transport.run(commands.image_id_argv(image))
            if not found.ok:
                raise ImageMissingError(
                    f"{node.host}: {path} was loaded but holds no image {image}",
                    f"make the file with docker save {image} -o FILE",
                )
            probes[node.host].image_id = found.stdout.strip()
            return shipped

        sent = self._parallel(load, lacking)
        each = "; ".join(f"{host}: {what}" for host, what in sent.items())
        report.notes.append(f"loaded {os.path.basename(path)} on {len(lacking)} node(s) ({each})")

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

    def _plan(
        self, probes: dict[str, NodeProbe], image: str, backend: str = "ray"
    ) -> list[NodeLaunch]:
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
        extra = self._node_secrets(probes[inv.head.host], backend)
        for name in FORWARDED_SECRETS:
            if os.environ.get(name):
                extra[name] = os.environ[name]
        return node_launches(inv, facts, secrets=extra, image=image, backend=backend)

    def _node_secrets(self, head_probe: NodeProbe, backend: str) -> dict[str, str]:
        """What every node's container gets, through its 0600 env file, kept from a running
        head (so that a second `up` leaves the containers alone): the cluster secret, which
        nodes and data-parallel replicas prove when they join (engine/distributed/join.py), and
        on the Ray backend Ray's token (only its holders can use the cluster's ports)."""
        inv = self.inventory
        current: dict[str, str] = {}
        if head_probe.container is not None:
            path = env_file_path(head_probe.home, inv.name, inv.head.ip)
            current = self._read_env(inv.head, path)
        node_secrets = {}
        if backend == "ray":
            token = current.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)
            node_secrets.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        node_secrets[CLUSTER_SECRET_ENV] = current.get(CLUSTER_SECRET_ENV) or make_secret()
        return node_secrets

    def _read_env(self, node: NodeSpec, path: str) -> dict[str, str]:
        try:
            with self.transports[node.host].open(path, "rb") as f:
                text = f.read().decode()
        except OSError:
            return {}
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def _ray_nodes(self, head_host: str) -> list[RayNode]:
        return ray_nodes(self.transports[head_host], self.container)

    # -- down, status, logs, exec -------------------------------------------------------------
    def down(self, *, dry_run: bool = False) -> Report:
        report = Report(self.inventory.name, [], dry_run=dry_run)

        def take_down(node: NodeSpec) -> NodeRow:
            row = NodeRow(node.host, "head" if node.head else "worker", node.ip)
            row.container = self.container
            transport = self.transports[node.host]
            try:
                env_file = env_file_path(transport.home(), self.inventory.name, node.ip)
                state = inspect_container(transport, self.container)
                action = removal(node.host, self.container, state, env_file)
                row.action = carry_out_removal(transport, action, dry_run)
            except ClusterError as exc:
                row.action, row.error = "failed", exc.message
            return row

        for node in self.inventory.nodes:
            report.commands[node.host] = [commands.docker_rm_argv(self.container)]
        rows = self._parallel(take_down, self.inventory.nodes)
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
        report.backend = self.backend()
        present = [n for n in self.inventory.nodes if rows[n.host].status not in _NOT_THERE]
        report.joins = self._joins(present) if present else None
        if head_row.status == "running" and report.backend == "mp":
            group = GroupServer(self.inventory, self.transports, self.container)
            record = group.record()
            if record is not None and record.backend == "mp":
                states = group.node_states(record)
                report.server = (record, states[self.inventory.head.host])
                report.server_nodes = states
            report.server_note = self._unreadable(group)
        elif head_row.status == "running":
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
            report.server_note = self._unreadable(server)
        if report.server is not None:
            record = report.server[0]
            report.api_key = api_key_source(record, self.inventory)
            argvs = [record.argv, *(argv for _, argv in record.workers)]
            if any("--insecure-join" in argv for argv in argvs):
                report.joins = "not authenticated: the server runs with --insecure-join"
        return report

    def _unreadable(self, server: HeadServer) -> str | None:
        """What status says of a server record that this llmctl cannot read."""
        path = server.unreadable_record()
        if path is None:
            return None
        return (
            f"unknown: the record {self.inventory.head.host}:{path} is not one this llmctl "
            "can use (another version's, or another inventory's of this name); `llmctl serve -i "
            f"{self.inventory.source}` stops that server and starts its own"
        )

    def _joins(self, nodes: list[NodeSpec]) -> str:
        """Whether the nodes prove one cluster secret when they join: each node's env file
        holds the same (compared by digest; the secret itself is never shown)."""
        inv = self.inventory

        def digest(node: NodeSpec) -> str | None:
            path = env_file_path(self.transports[node.host].home(), inv.name, node.ip)
            value = self._read_env(node, path).get(CLUSTER_SECRET_ENV)
            return hashlib.sha256(value.encode()).hexdigest() if value else None

        digests = self._parallel(digest, nodes)
        lacking = [host for host, d in digests.items() if d is None]
        again = f"run `llmctl cluster up -i {inv.source}` again"
        if lacking:
            return f"not authenticated: no cluster secret on {', '.join(lacking)} ({again})"
        if len(set(digests.values())) > 1:
            return f"not authenticated: the nodes hold different cluster secrets ({again})"
        return (
            f"authenticated: the {len(nodes)} nodes share one cluster secret "
            f"({CLUSTER_SECRET_ENV} in each node's 0600 env file)"
        )

    def backend(self) -> str:
        """The backend the head's container was started on (its label): ray or mp."""
        transport = self.transports[self.inventory.head.host]
        state = inspect_container(transport, self.container)
        return (state.labels.get(commands.LABEL_BACKEND) if state else None) or "ray"

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
