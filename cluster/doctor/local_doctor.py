"""The doctor from this machine: its own facts and a local all-reduce, or (--ray) every node of
the Ray cluster it reaches. `llmctl doctor` and `doctor nccl` call these and render the result;
with -i the doctor runs from the cluster's containers instead (cluster_doctor.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DoctorRun:
    results: list  # CheckResult rows (doctor_checks.py); empty for the all-reduce alone
    reports: list  # each node's NodeReport
    collectives: list  # CollectiveReport of each all-reduce run


def check_here(
    ray: bool, model: str | None, nvlink: bool | None, backend: str, world_size: int,
    timeout: float, allreduce: bool = True,
) -> DoctorRun:  # fmt: skip
    """The checklist: each node's facts (this one, or the Ray cluster's), then the all-reduce."""
    from llmctl.cluster.doctor import collective_check, ray_doctor
    from llmctl.cluster.doctor.doctor_checks import run_checks
    from llmctl.cluster.doctor.node_facts import collect_local_report

    if ray:
        run = ray_doctor.run_on_ray(timeout, backend, model=model, collective=allreduce)
        reports, collectives = list(run.reports), list(run.collectives)
    else:
        reports = [collect_local_report(model)]
        backends = collective_check.local_backends(backend) if allreduce else []
        collectives = [collective_check.run_local(world_size, b, timeout) for b in backends]
    results = run_checks(reports, expect_nvlink=nvlink, collectives=collectives)
    return DoctorRun(results, reports, collectives)


def allreduce_here(
    ray: bool, backend: str, world_size: int, timeout: float, nodes: dict | None = None
) -> tuple[list, dict]:
    """The all-reduce check alone: (CollectiveReports, the JSON payload). `nodes`: --nnodes,
    --node-rank, --master-addr, --master-port for one group across nodes without Ray."""
    from llmctl.cluster.doctor import collective_check, ray_doctor

    if ray:
        run = ray_doctor.run_on_ray(timeout, backend)
        return list(run.collectives), run.to_json()
    names = collective_check.local_backends(backend)
    if nodes and nodes["nnodes"] > 1:
        names = names[-1:]  # one group per start of the other nodes: NCCL where it runs
    collectives = [
        collective_check.run_local(world_size, name, timeout, **(nodes or {})) for name in names
    ]
    return collectives, {"collectives": [c.to_json() for c in collectives]}
