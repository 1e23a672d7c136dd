"""`llmctl doctor -i cluster.yaml` on an mp cluster (`cluster up --backend mp`: no Ray to reach
the nodes): the facts from each node's container, the all-reduce on the mp group's rendezvous.

    facts      every node, in parallel: `llmctl doctor check --json --no-allreduce` in its
               container (this node's NodeReport, as the Ray doctor's actors collect it)
    all-reduce one rank per node, as `llmctl doctor nccl --nnodes` runs it by hand: nodes
               1..N-1 start `llmctl serve --headless -pp N --nnodes N --node-rank R
               --master-addr HEAD --master-port P` (detached, pid and log in the container's
               /root/.llmctl/doctor.*), then the head runs `llmctl doctor nccl --nnodes N ...`
               as node 0; the headless nodes end when it ends the group (or at the timeout)
    checks     run here, on every node's report and the all-reduce report: the same rows as
               on Ray

The group's port is DOCTOR_PORT, not the server's: the doctor runs beside a serving group.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from llmctl.cluster.doctor.cluster_doctor import ClusterDoctorRun, _json_object
from llmctl.cluster.doctor.collective_report import CollectiveReport
from llmctl.cluster.doctor.doctor_checks import CheckResult, run_checks
from llmctl.cluster.doctor.node_facts import NodeReport, distinct_names
from llmctl.cluster.inventory import ordered_nodes
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.head_server import launch_argv
from llmctl.cluster.launch.launcher import Cluster
from llmctl.cluster.plan.node_commands import MASTER_PORT

DOCTOR_PORT = MASTER_PORT + 10  # and the port after it
PID_FILE = "/root/.llmctl/doctor.pid"
LOG_FILE = "/root/.llmctl/doctor.log"


def facts_argv(container: str, model: str | None) -> list[str]:
    """This node's report, no all-reduce, as JSON."""
    argv = ["env", "COLUMNS=160", "llmctl", "doctor", "check", "--json", "--no-allreduce"]
    return commands.docker_exec_argv(container, argv + (["--model", model] if model else []))


def group_argvs(
    container: str, *, head_ip: str, nnodes: int, backend: str, timeout: float, json_out: bool
) -> list[list[str]]:
    """The all-reduce's commands, node 0 (the head, run to completion) first, then nodes
    1..N-1 (detached), one rank per node."""
    where = ["--nnodes", str(nnodes), "--master-addr", head_ip, "--master-port", str(DOCTOR_PORT)]
    head = ["env", "COLUMNS=160", "llmctl", "doctor", "nccl", *(["--json"] if json_out else [])]
    head += ["--backend", backend, "--world-size", str(nnodes), *where]
    head += ["--timeout", f"{timeout:g}"]
    argvs = [commands.docker_exec_argv(container, head)]
    for rank in range(1, nnodes):
        node = ["llmctl", "serve", "--headless", "-pp", str(nnodes), *where]
        node += ["--node-rank", str(rank), "--rendezvous-timeout", f"{timeout:g}"]
        argvs.append(launch_argv(container, node, PID_FILE, LOG_FILE))
    return argvs


def run_mp_doctor(
    cluster: Cluster,
    results: list[CheckResult],
    *,
    nccl: bool = False,
    backend: str = "auto",
    timeout: float = 60.0,
    nvlink: bool | None = None,
) -> ClusterDoctorRun:
    """The doctor on an mp cluster; `results` are the container rows already found."""
    inv = cluster.inventory
    nodes = ordered_nodes(inv)
    transports = [cluster.transports[n.host] for n in nodes]
    reports: list[NodeReport] = []
    if not nccl:
        reports = node_reports(cluster, results, timeout)
        if reports is None:
            return ClusterDoctorRun(results, {"ok": False})
    head, *others = group_argvs(
        cluster.container, head_ip=inv.head.ip, nnodes=len(nodes), backend=backend,
        timeout=timeout, json_out=not nccl,
    )  # fmt: skip
    for transport, argv in zip(transports[1:], others, strict=True):
        started = transport.run(argv)
        if not started.ok:
            detail = f"could not start its rank: {started.error_line()}"
            results.append(CheckResult("doctor", transport.name, "fail", detail))
            return ClusterDoctorRun(results, {"ok": False})
    group = transports[0].run(head, timeout=timeout * 6 + 60)
    if nccl:
        return ClusterDoctorRun(results, {"ok": group.ok}, text=group.stdout + group.stderr)
    collectives = collective_reports(group.stdout, [r.node for r in reports])
    if collectives is None:
        detail = f"the all-reduce did not report: {group.error_line()}"
        results.append(CheckResult("allreduce", nodes[0].host, "fail", detail,
                                   f"see each node's {LOG_FILE}"))  # fmt: skip
        collectives = []
    results += run_checks(reports, expect_nvlink=nvlink, collectives=collectives)
    payload = {
        "nodes": [r.to_json() for r in reports],
        "collectives": [c.to_json() for c in collectives],
    }
    return ClusterDoctorRun(results, payload)


def node_reports(
    cluster: Cluster, results: list[CheckResult], timeout: float
) -> list[NodeReport] | None:
    """Each node's report from its container, in node-rank order, named apart; None (and a
    failed row per node that gave none) when some node could not tell."""
    inv = cluster.inventory
    nodes = ordered_nodes(inv)
    argv = facts_argv(cluster.container, inv.model)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        found = list(
            pool.map(lambda n: cluster.transports[n.host].run(argv, timeout=timeout + 60), nodes)
        )
    reports = []
    for node, result in zip(nodes, found, strict=True):
        try:
            reports.append(NodeReport.from_json(_json_object(result.stdout)["nodes"][0]))
        except (ValueError, KeyError, IndexError):
            fix = f"run it there: llmctl cluster exec {node.host} -i {inv.source} -- llmctl doctor"
            results.append(CheckResult("doctor", node.host, "fail", result.error_line(), fix))
    return distinct_names(reports) if len(reports) == len(nodes) else None


def collective_reports(text: str, names: list[str]) -> list[CollectiveReport] | None:
    """The all-reduce reports of `doctor nccl --json`, each rank's node named as the facts
    name it (one rank per node, in node-rank order); None when it printed none."""
    try:
        payload = _json_object(text)
        reports = [CollectiveReport.from_json(c) for c in payload["collectives"]]
    except (ValueError, KeyError, TypeError):
        return None
    return [
        dataclasses.replace(r, nodes=tuple(names[i] for i in range(r.world_size)))
        for r in reports
        if r.world_size <= len(names)
    ]
