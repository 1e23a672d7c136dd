"""The doctor's checklist: pure functions from NodeReports (head first) to one CheckResult per
check and node. No I/O: the reports are collected elsewhere (node_facts, the Ray driver).

Every result that is not a pass names the node, says what is wrong and, in `fix`, what to change.
Checks that do not apply (no model given, no NVLink expectation) produce no rows.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from llmctl.cluster.doctor.collective_report import CollectiveReport, format_bytes
from llmctl.cluster.doctor.nccl_log import assess_transport
from llmctl.cluster.doctor.node_facts import NodeReport
from llmctl.cluster.launch.invariants import model_copies, own_address
from llmctl.cluster.launch.parsers import Address

Status = Literal["pass", "warn", "fail"]
MIB = 1 << 20
GIB = 1 << 30
SHM_FAIL_BYTES = 1 * GIB  # Docker's default 64 MiB is the usual culprit
SHM_WARN_BYTES = 4 * GIB
SHM_FIX = "run the container with --shm-size 10.24g or --ipc=host (llmctl cluster up does)"
INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# May differ from node to node: addresses, interfaces and HCAs are each node's own; debug output.
PER_NODE_VARIABLES = frozenset(
    {
        "VLLM_HOST_IP",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_DEBUG",
        "NCCL_DEBUG_FILE",
        "NCCL_DEBUG_SUBSYS",
    }
)
# Of RAY_*, only these must agree; Ray sets many per-process ones (RAY_RAYLET_PID, ...) itself.
RAY_SHARED_VARIABLES = frozenset({"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"})
_SHARED_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "TORCH_NCCL_")


@dataclass(frozen=True)
class CheckResult:
    check: str
    node: str
    status: Status
    detail: str
    fix: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def run_checks(
    reports: Sequence[NodeReport],
    *,
    expect_nvlink: bool | None = None,
    collectives: Sequence[CollectiveReport] = (),
) -> list[CheckResult]:
    """Every check on every node, grouped by check; `reports[0]` is the head. `collectives` are
    all-reduce checks already run (collective_check), turned into rows too."""
    if not reports:
        return []
    results: list[CheckResult] = []
    results += [check_host_ip(r, len(reports)) for r in reports]
    results += [check_ifname(r) for r in reports]
    results += check_env_consistency(reports)
    results += [check_shm(r) for r in reports]
    results += check_versions(reports)
    results += check_model(reports)
    if expect_nvlink is not None:
        results += [check_nvlink(r, expect_nvlink) for r in reports]
    for collective in collectives:
        results += check_collective(collective)
    return results


def failed(results: Sequence[CheckResult]) -> bool:
    return any(r.status == "fail" for r in results)


def _listed(addresses: Sequence[Address]) -> str:
    return ", ".join(f"{a.ip} ({a.ifname})" for a in addresses) or "none"


def routable_addresses(report: NodeReport) -> list[Address]:
    """Addresses another node could reach: not loopback, not IPv6 link-local."""
    return [
        a
        for a in report.addresses
        if not a.interface.is_loopback and not a.interface.ip.is_link_local
    ]


def candidate_addresses(report: NodeReport) -> list[Address]:
    """The addresses vLLM and Ray choose VLLM_HOST_IP from: IPv4 ones, else IPv6 ones (a NIC's
    IPv6 address beside its IPv4 one is not a second choice)."""
    routable = routable_addresses(report)
    return [a for a in routable if a.interface.version == 4] or routable


def _result(status: Status) -> Callable[..., CheckResult]:
    def make(check: str, node: str, detail: str, fix: str | None = None) -> CheckResult:
        return CheckResult(check, node, status, detail, fix)

    return make


_pass, _warn, _fail = _result("pass"), _result("warn"), _result("fail")


def check_host_ip(report: NodeReport, cluster_size: int = 1) -> CheckResult:
    """VLLM_HOST_IP is one of the node's addresses and Ray's node IP; without it, the node has
    a single address to choose from (vLLM picks one by routing, Gloo by hostname)."""
    name, host_ip = report.node, report.host_ip
    routable = candidate_addresses(report)
    to_cluster_ip = f"set VLLM_HOST_IP on {name} to its address on the cluster network"
    if host_ip is None:
        if len(routable) > 1:
            detail = (
                f"VLLM_HOST_IP is unset and {name} has {len(routable)} addresses: "
                f"{_listed(routable)}; vLLM, Ray and Gloo may each pick a different one"
            )
            fix = f"{to_cluster_ip} (e.g. {report.ray_ip or routable[0].ip})"
            # One node alone works whatever it picks; in a cluster the nodes may not meet.
            return (_fail if cluster_size > 1 else _warn)("host_ip", name, detail, fix)
        only = routable[0].ip if routable else "127.0.0.1"
        return _pass("host_ip", name, f"VLLM_HOST_IP unset; the only address is {only}")
    try:
        ipaddress.ip_address(host_ip)
    except ValueError:
        detail = f"VLLM_HOST_IP={host_ip!r} on {name} is not an IP address"
        return _fail("host_ip", name, detail, f"{to_cluster_ip} ({_listed(routable)})")
    own = own_address(host_ip, report.addresses)
    if own is None:
        detail = f"VLLM_HOST_IP={host_ip} is not an address of {name} (it has {_listed(routable)})"
        return _fail("host_ip", name, detail, f"set VLLM_HOST_IP on {name} to one of its own")
    if own.interface.is_loopback and cluster_size > 1:
        detail = f"VLLM_HOST_IP={host_ip} on {name} is loopback; other nodes cannot reach it"
        return _fail("host_ip", name, detail, f"{to_cluster_ip} ({_listed(routable)})")
    if report.ray_ip is not None and report.ray_ip != host_ip:
        detail = f"VLLM_HOST_IP={host_ip} on {name} but Ray knows the node as {report.ray_ip}"
        fix = (
            f"start Ray on {name} with --node-ip-address={host_ip} (llmctl cluster up does), "
            f"or set VLLM_HOST_IP={report.ray_ip}"
        )
        return _fail("host_ip", name, detail, fix)
    ray = " = Ray's node IP" if report.ray_ip else ""
    return _pass("host_ip", name, f"VLLM_HOST_IP={host_ip} on {own.ifname}{ray}")


@dataclass(frozen=True)
class IfnameSpec:
    """NCCL_SOCKET_IFNAME's syntax: comma-separated prefixes; a leading `^` excludes them; a
    leading `=` (after any `^`) matches exact names instead of prefixes."""

    names: tuple[str, ...]
    exclude: bool = False
    exact: bool = False

    @classmethod
    def parse(cls, value: str) -> IfnameSpec:
        exclude = value.startswith("^")
        value = value[1:] if exclude else value
        exact = value.startswith("=")
        value = value[1:] if exact else value
        return cls(tuple(n for n in (p.strip() for p in value.split(",")) if n), exclude, exact)

    def _matches(self, ifname: str) -> bool:
        if self.exact:
            return ifname in self.names
        return any(ifname.startswith(n) for n in self.names)

    def select(self, ifnames: Sequence[str]) -> list[str]:
        return [i for i in ifnames if self._matches(i) != self.exclude]


def selected_interfaces(variable: str, value: str, ifnames: Sequence[str]) -> list[str]:
    """The interfaces a variable selects among `ifnames`: NCCL's prefix syntax, or Gloo's exact
    comma-separated names."""
    if variable.startswith("NCCL_"):
        return IfnameSpec.parse(value).select(ifnames)
    wanted = [n.strip() for n in value.split(",") if n.strip()]
    return [n for n in wanted if n in ifnames]


def check_ifname(report: NodeReport) -> CheckResult:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME select existing interfaces, including the one of
    VLLM_HOST_IP."""
    name = report.node
    ifnames = report.interface_names()
    own = own_address(report.host_ip, report.addresses) if report.host_ip else None
    target = own.ifname if own else None
    suggestion = target or next((a.ifname for a in routable_addresses(report)), None)
    set_vars = {v: report.env[v] for v in INTERFACE_VARIABLES if report.env.get(v)}
    if not set_vars:
        routable = sorted({a.ifname for a in routable_addresses(report)})
        if len(routable) > 1:
            detail = (
                f"NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are unset and {name} has "
                f"{len(routable)} interfaces ({', '.join(routable)}); Gloo uses the one its "
                "hostname resolves to"
            )
            fix = f"set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on {name} to {suggestion}"
            return _warn("ifname", name, detail, fix)
        return _pass("ifname", name, "unset; NCCL and Gloo find the interface")
    problems, warnings, notes = [], [], []
    for variable, value in set_vars.items():
        chosen = selected_interfaces(variable, value, ifnames)
        missing = [n for n in (p.strip() for p in value.split(",")) if n and n not in ifnames]
        if variable.startswith("GLOO_") and missing:  # Gloo takes exact names only
            problems.append(f"{variable}={value} names {', '.join(missing)}, missing")
        elif not chosen:
            problems.append(f"{variable}={value} matches no interface")
        elif target and target not in chosen:
            selected = ", ".join(chosen)
            warnings.append(f"{variable}={value} selects {selected}; VLLM_HOST_IP is on {target}")
        else:
            notes.append(f"{variable}={value} -> {', '.join(chosen)}")
    has = f" on {name} (it has {', '.join(ifnames) or 'no interfaces'})"
    fix = f"set {' and '.join(set_vars)} on {name} to {suggestion or 'an existing interface'}"
    if problems:
        return _fail("ifname", name, "; ".join(problems) + has, fix)
    if warnings:
        return _warn("ifname", name, "; ".join(warnings), fix)
    return _pass("ifname", name, "; ".join(notes))


def shared_variables(env: dict[str, str]) -> dict[str, str]:
    """The variables of a node's env that must be the same on every node."""
    return {
        k: v
        for k, v in env.items()
        if k not in PER_NODE_VARIABLES
        and (k.startswith(_SHARED_PREFIXES) or k in RAY_SHARED_VARIABLES)
    }


def _show(value: str | None) -> str:
    return "unset" if value is None else f"={value}"


def check_env_consistency(reports: Sequence[NodeReport]) -> list[CheckResult]:
    """Variables that must agree (NCCL_IB_DISABLE, VLLM_*, RAY_AUTH_MODE, ...) equal the head's."""
    head = reports[0]
    reference = shared_variables(head.env)
    listed = f": {', '.join(reference)}" if reference else ""
    results = [_pass("env", head.node, f"reference (head): {len(reference)} shared{listed}")]
    for report in reports[1:]:
        mine = shared_variables(report.env)
        differ = sorted(k for k in set(reference) | set(mine) if reference.get(k) != mine.get(k))
        if not differ:
            results.append(_pass("env", report.node, "same as the head"))
            continue
        detail = "; ".join(
            f"{k}{_show(mine.get(k))} here, {_show(reference.get(k))} on {head.node}"
            for k in differ
        )
        fix = f"give {', '.join(differ)} the same value on every node (the inventory's `env:`)"
        results.append(_fail("env", report.node, detail, fix))
    return results


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def check_shm(report: NodeReport) -> CheckResult:
    """/dev/shm holds NCCL's SHM transport and the engine's shared-memory collectives."""
    name, size = report.node, report.shm_bytes
    if size is None:
        return _fail("shm", name, f"{name} has no /dev/shm", SHM_FIX)
    if size < SHM_FAIL_BYTES:
        detail = f"/dev/shm on {name} is {_gib(size)}, below {_gib(SHM_FAIL_BYTES)}"
        return _fail("shm", name, detail, SHM_FIX)
    if size < SHM_WARN_BYTES:
        detail = f"/dev/shm on {name} is {_gib(size)}; large tensor-parallel groups need more"
        return _warn("shm", name, detail, SHM_FIX)
    return _pass("shm", name, f"/dev/shm is {_gib(size)}")


def _minor(version: str | None) -> str | None:
    return ".".join(version.split(".")[:2]) if version else None


def check_versions(reports: Sequence[NodeReport]) -> list[CheckResult]:
    """Python, torch, Ray and llmctl equal to the head's (a Python patch release only warns)."""
    head = reports[0]
    names = ("python", "torch", "ray", "llmctl")
    summary = ", ".join(f"{n} {head.versions.get(n) or '-'}" for n in names)
    results = [_pass("versions", head.node, f"reference (head): {summary}")]
    for report in reports[1:]:
        hard, soft = [], []
        for n in names:
            mine, theirs = report.versions.get(n), head.versions.get(n)
            if mine != theirs:
                text = f"{n} {mine or 'missing'} here, {theirs or 'missing'} on {head.node}"
                patch_only = n == "python" and _minor(mine) == _minor(theirs)
                (soft if patch_only else hard).append(text)
        fix = f"install the head's versions on {report.node} (use the same container image)"
        if hard:
            results.append(_fail("versions", report.node, "; ".join(hard + soft), fix))
        elif soft:
            results.append(_warn("versions", report.node, "; ".join(soft), fix))
        else:
            results.append(_pass("versions", report.node, "same as the head"))
    return results


def check_model(reports: Sequence[NodeReport]) -> list[CheckResult]:
    """The model's fingerprint on each node equals the head's; no rows without a model."""
    head = reports[0]
    model = next((r.model for r in reports if r.model), None)
    if model is None:
        return []
    copies = model_copies([r.model_fingerprint for r in reports], fallback=False)
    results = []
    for report, copy in zip(reports, copies, strict=True):
        name, mine, expected = report.node, copy.fingerprint, copy.expected
        if copy.status == "missing":
            fix = f"copy it to {model} on {name} (llmctl cluster up --sync-model)"
            results.append(_fail("model", name, f"the model {model} is missing on {name}", fix))
        elif copy.status in ("reference", "unknown"):
            results.append(_pass("model", name, f"fingerprint {mine}"))
        elif copy.status == "differs":
            detail = (
                f"the model {model} on {name} differs from {head.node}'s "
                f"(fingerprint {mine} vs {expected})"
            )
            fix = f"make {model} on {name} identical to the head's copy"
            results.append(_fail("model", name, detail, fix))
        else:
            results.append(_pass("model", name, f"same as the head ({expected})"))
    return results


def check_nvlink(report: NodeReport, expected: bool) -> CheckResult:
    """The plan assumed NVLink between the GPUs of each node (tensor parallel inside a node)."""
    name = report.node
    if not expected:
        return _pass("nvlink", name, "the plan assumes PCIe; NVLink not needed")
    fix = (
        "plan for PCIe instead (llmctl plan ... --interconnect pcie: pipeline stages rather "
        "than tensor parallel inside the node), or check `nvidia-smi nvlink --status`"
    )
    if report.nvlink:
        return _pass("nvlink", name, "NVLink between the GPUs")
    if report.nvlink is False:
        return _fail("nvlink", name, f"the plan assumes NVLink; {name}'s GPUs use PCIe", fix)
    if report.gpus is not None and report.gpus < 2:
        detail = f"the plan assumes NVLink; {name} has {report.gpus} GPU(s), no pair to link"
        return _fail("nvlink", name, detail, fix)
    return _warn("nvlink", name, f"the plan assumes NVLink; {name} cannot tell", fix)


def check_collective(report: CollectiveReport) -> list[CheckResult]:
    """An all-reduce check as rows: the whole collective on the head's row (or a fail row per
    rank that hung or died), then one row per link from rank 0, with NCCL's transport."""
    check = f"allreduce/{report.backend}"
    if report.error is not None:
        nodes = dict.fromkeys(report.nodes[r] for r in report.failed_ranks)
        return [_fail(check, node, report.error, report.hint) for node in nodes]
    results = []
    timings = "; ".join(
        f"{format_bytes(s.size_bytes)}: {s.time_us:.0f} us"
        + (f", busbw {s.busbw_gbps:.2f} GB/s" if s.size_bytes >= MIB else "")
        for s in report.sizes
    )
    where = f"{report.world_size} rank(s)"
    if report.correct:
        results.append(_pass(check, report.nodes[0], f"{where}, sums correct; {timings}"))
    else:
        wrong = ", ".join(format_bytes(s.size_bytes) for s in report.sizes if not s.correct)
        fix = "a rank computes or transmits corrupt data: check its device and network"
        results.append(_fail(check, report.nodes[0], f"{where}: wrong sums at {wrong}", fix))
    for link in report.links:
        status, assessment, fix = assess_transport(link.transport, link.src_node != link.dst_node)
        detail = (
            f"rank {link.src_rank} ({link.src_node}) -> rank {link.dst_rank}: "
            f"{link.latency_us:.0f} us, {link.bandwidth_gbps:.2f} GB/s"
            + (f"; {assessment}" if link.transport else "")
        )
        results.append(CheckResult(f"link/{report.backend}", link.dst_node, status, detail, fix))
    if report.transport is not None and not report.links:
        status, assessment, fix = assess_transport(report.transport, report.cross_node)
        results.append(
            CheckResult(f"transport/{report.backend}", report.nodes[0], status, assessment, fix)
        )
    return results
