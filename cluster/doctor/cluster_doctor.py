"""`llmctl doctor -i cluster.yaml`: the doctor run from a laptop against an inventory's cluster.

Each node's container is inspected over SSH (a stopped or missing one fails, named by its node);
then `llmctl doctor --ray --json` runs inside the head container, where Ray reaches every node,
and its rows join the container rows. On an mp cluster (no Ray) mp_doctor.py runs instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llmctl.cluster.doctor.doctor_checks import CheckResult
from llmctl.cluster.errors import ClusterError
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.launcher import Cluster
from llmctl.cluster.launch.probe import inspect_container


@dataclass
class ClusterDoctorRun:
    results: list[CheckResult]
    payload: dict = field(default_factory=dict)  # the head's JSON (nodes, collectives)
    text: str = ""  # `doctor nccl`: the head's own rendering

    @property
    def ok(self) -> bool:
        return not any(r.status == "fail" for r in self.results) and self.payload.get("ok", True)


def container_checks(cluster: Cluster) -> list[CheckResult]:
    """One row per node: its container exists and runs."""
    results = []
    name = cluster.container
    up = f"llmctl cluster up -i {cluster.inventory.source}"
    for node in cluster.inventory.nodes:
        try:
            state = inspect_container(cluster.transports[node.host], name)
        except ClusterError as exc:
            results.append(CheckResult("container", node.host, "fail", exc.message, exc.hint))
            continue
        if state is None:
            results.append(CheckResult("container", node.host, "fail", f"no container {name}", up))
        elif not state.running:
            detail = f"{name} is {state.status} (exit code {state.exit_code})"
            fix = f"see llmctl cluster logs {node.host} -i {cluster.inventory.source}; then {up}"
            results.append(CheckResult("container", node.host, "fail", detail, fix))
        else:
            results.append(CheckResult("container", node.host, "pass", f"{name} is running"))
    return results


def doctor_argv(
    container: str,
    *,
    nccl: bool,
    model: str | None,
    backend: str,
    timeout: float,
    nvlink: bool | None = None,
) -> list[str]:
    argv = ["env", "COLUMNS=160", "llmctl", "doctor"]
    argv += ["nccl"] if nccl else ["check", "--json"]
    argv += ["--ray", "--backend", backend, "--timeout", f"{timeout:g}"]
    if not nccl and model:
        argv += ["--model", model]
    if not nccl and nvlink is not None:
        argv.append("--nvlink" if nvlink else "--pcie")
    return commands.docker_exec_argv(container, argv)


def run_doctor(
    cluster: Cluster,
    *,
    nccl: bool = False,
    backend: str = "auto",
    timeout: float = 60.0,
    nvlink: bool | None = None,
) -> ClusterDoctorRun:
    results = container_checks(cluster)
    head = cluster.inventory.head
    if any(r.node == head.host and r.status == "fail" for r in results):
        return ClusterDoctorRun(results)  # nothing to run the rest on
    if cluster.backend() == "mp":  # no Ray: facts per container, the all-reduce over mp
        from llmctl.cluster.doctor.mp_doctor import run_mp_doctor

        if any(r.status == "fail" for r in results):
            return ClusterDoctorRun(results)  # a rank per node: every container must run
        return run_mp_doctor(
            cluster, results, nccl=nccl, backend=backend, timeout=timeout, nvlink=nvlink
        )
    argv = doctor_argv(
        cluster.container, nccl=nccl, model=cluster.inventory.model, backend=backend,
        timeout=timeout, nvlink=nvlink,
    )  # fmt: skip
    result = cluster.transports[head.host].run(argv, timeout=timeout * 6 + 60)
    if nccl:
        run = ClusterDoctorRun(results, {"ok": result.ok}, text=result.stdout + result.stderr)
        return run
    try:
        payload = _json_object(result.stdout)
    except ValueError:
        payload = {"error": result.error_line(), "hint": None}
    if "checks" not in payload:  # it could not run (a typed error, as JSON): one failed row
        hint = payload.get("hint") or (
            f"run it there to see why: llmctl cluster exec head -i {cluster.inventory.source}"
            " -- llmctl doctor --ray"
        )
        results.append(CheckResult("doctor", head.host, "fail", str(payload.get("error")), hint))
        return ClusterDoctorRun(results, {"ok": False})
    results += [CheckResult(**row) for row in payload["checks"]]
    return ClusterDoctorRun(results, payload)


def _json_object(text: str) -> dict:
    """The JSON object `doctor --json` printed, whatever Ray printed around it (a rank's
    traceback, for one, when its all-reduce raised)."""
    start = 0 if text.startswith("{") else text.find("\n{") + 1
    if start == 0 and not text.startswith("{"):
        raise ValueError("no JSON object")
    payload, _ = json.JSONDecoder().raw_decode(text[start:])
    return payload
