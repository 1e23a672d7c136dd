"""`cluster up --head/--worker` and `cluster down` without an inventory: this node's container,
over a LocalTransport, under a stable name (what run_cluster.sh does, but detached). On Ray it runs
this node's Ray; on the mp backend (`--backend mp`) it idles with the node's env, as `cluster up -i
--backend mp` leaves it, and the user execs this node's `llmctl serve --nnodes ...` in it."""

from __future__ import annotations

from llmctl.cluster.errors import (
    ConfigError,
    DockerUnavailableError,
    ImageMissingError,
    NodeNetworkError,
)
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.commands import BACKENDS
from llmctl.cluster.launch.invariants import own_address
from llmctl.cluster.launch.launch_report import DONE, NodeRow, Report, describe
from llmctl.cluster.launch.node_launch import (
    NodeFacts,
    NodeLaunch,
    local_container_name,
    local_launch,
)
from llmctl.cluster.launch.probe import docker_problem, inspect_container, probe_node
from llmctl.cluster.launch.transport import LocalTransport, Transport
from llmctl.cluster.launch.up_diff import Keep, node_action, removal
from llmctl.cluster.launch.up_executor import (
    RAY_WAIT_S,
    carry_out_removal,
    container_versions,
    start,
    wait_for_ray,
)
from llmctl.engine import envs
from llmctl.engine.distributed.join import SECRET_ENV as CLUSTER_SECRET_ENV


def up_local(
    transport: Transport, launch: NodeLaunch, *, dry_run: bool = False, wait_s: float = RAY_WAIT_S
) -> Report:
    """`cluster up --head/--worker`: this node's container, detached, under a stable name."""
    report = Report(launch.cluster, [], dry_run=dry_run)
    action = node_action(launch, inspect_container(transport, launch.container))
    describe([action], report)
    if not dry_run and not isinstance(action, Keep):
        start(transport, launch)
        report.rows[0].action = DONE[action.verb]
    if dry_run:
        return report
    if launch.backend == "ray":
        wait_for_ray(transport, launch, wait_s)
        return report
    report.backend = launch.backend
    report.rows[0].versions = container_versions(transport, launch, wait_s)
    if not report.rows[0].versions.get("llmctl"):
        raise ImageMissingError(
            f"the image {launch.image} has no llmctl", "build it with llmctl image build --no-ray"
        )
    report.notes.append(mp_next_step(launch))
    return report


def mp_next_step(launch: NodeLaunch) -> str:
    """What to run in an mp container once every node's is up (vLLM's multi-node mp flags)."""
    serve = "llmctl serve MODEL -tp T -pp P --distributed-executor-backend mp --nnodes N"
    if launch.role == "head":
        where = f"--node-rank 0 --master-addr {launch.ip} --host 0.0.0.0"
    else:
        where = f"--node-rank R --master-addr {launch.head_ip} --headless"
    step = (
        f"start this node's part of the group (node 0 serves the API, the others run "
        f"--headless; the same -tp, -pp, --nnodes everywhere): docker exec -d "
        f"{launch.container} {serve} {where}"
    )
    if CLUSTER_SECRET_ENV not in launch.env_dict():
        step += (
            f"; the nodes prove one cluster secret when they join: export {CLUSTER_SECRET_ENV} "
            "(the same on every node, e.g. from `python3 -c 'import secrets; "
            "print(secrets.token_hex(32))'`) before `llmctl cluster up` on each node"
        )
    return step


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
    backend: str = "ray",
) -> Report:
    """Probe this node, build its NodeLaunch, and bring its container up."""
    if not ip:
        raise ConfigError("this node's IP is not known", "pass --ip or set VLLM_HOST_IP")
    if role == "worker" and not head_ip:
        raise ConfigError("--worker needs the head's address", "pass --head-ip HEAD_IP")
    if not image:
        raise ConfigError("no image given", "pass --image llmctl:latest (see llmctl image build)")
    transport = transport or LocalTransport()
    probe = probe_node(transport, image, None, local_container_name(role, backend))
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
    env = dict(env or {})
    if envs.LLMCTL_CLUSTER_SECRET:  # to the container's 0600 env file, as -i does
        env.setdefault(CLUSTER_SECRET_ENV, envs.LLMCTL_CLUSTER_SECRET)
    launch = local_launch(
        role, ip, head_ip or ip, image, facts, hf_home=hf_home, gpus=gpus, env=env,
        backend=backend,
    )  # fmt: skip
    return up_local(transport, launch, dry_run=dry_run)


def down_local(transport: Transport, *, dry_run: bool = False) -> Report:
    """Remove this node's `cluster up --head/--worker` containers: one row per role, the Ray
    container's, or the mp one's (a row each when both are there)."""
    report = Report("local", [], dry_run=dry_run)
    for role in ("head", "worker"):
        names = [local_container_name(role, backend) for backend in BACKENDS]
        states = {name: inspect_container(transport, name) for name in names}
        for name in [n for n in names if states[n] is not None] or names[:1]:
            row = NodeRow(transport.name, role, "", container=name)
            report.commands[transport.name] = report.commands.get(transport.name, []) + [
                commands.docker_rm_argv(name)
            ]
            action = removal(transport.name, name, states[name])
            row.action = carry_out_removal(transport, action, dry_run)
            report.changed |= row.action == "removed"
            report.rows.append(row)
    return report
