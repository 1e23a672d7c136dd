"""The all-reduce check's results: what one rank measured (RankResult) and the one
CollectiveReport a driver gathers from every rank (`merge_results`), or builds when the check did
not complete (`failure_report`: a timeout naming the ranks that were behind, or a rank that died).

Bandwidths follow nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n for all-reduce.
Times are the slowest rank's. Pure: no torch, no processes, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from llmctl.cluster.doctor.nccl_log import assess_transport, weakest
from llmctl.cluster.errors import CollectiveError, CollectiveTimeoutError

MiB = 1 << 20
# What a rank reports as it goes, in order; a failed check names each rank's last one.
STAGES = ("starting", "rendezvous", "warm-up", "all-reduce", "links", "done")


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: each rank sends and receives 2(n-1)/n of the data."""
    return algbw * 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class SizeResult:
    size_bytes: int
    iterations: int
    time_us: float  # mean time of one all-reduce, slowest rank
    algbw_gbps: float  # GB/s (1e9 bytes)
    busbw_gbps: float
    correct: bool = True  # every rank saw the exact sum


@dataclass(frozen=True)
class LinkResult:
    src_rank: int
    dst_rank: int
    latency_us: float  # one way: half the round trip of a 4-byte message
    bandwidth_gbps: float  # LINK_BYTES from src to dst, per second
    src_node: str = ""
    dst_node: str = ""
    transport: str | None = None  # NCCL only


@dataclass(frozen=True)
class RankResult:
    rank: int
    node: str
    pid: int
    sizes: tuple[SizeResult, ...]
    links: tuple[LinkResult, ...] = ()  # measured by rank 0
    wrong_sizes: tuple[int, ...] = ()  # sizes whose sum was wrong on this rank
    transport: str | None = None  # the weakest transport in this rank's NCCL log
    nccl_lines: tuple[str, ...] = ()  # the transport lines of that log


@dataclass(frozen=True)
class CollectiveReport:
    backend: str
    world_size: int
    nodes: tuple[str, ...]  # the node of each rank
    sizes: tuple[SizeResult, ...] = ()
    links: tuple[LinkResult, ...] = ()
    transport: str | None = None  # NCCL: the weakest transport any rank used
    error: str | None = None  # the check did not complete: why, naming the ranks
    hint: str | None = None
    stages: tuple[str | None, ...] = ()  # each rank's last stage when it failed
    failed_ranks: tuple[int, ...] = ()
    nccl_lines: tuple[str, ...] = ()

    @property
    def correct(self) -> bool:
        return all(s.correct for s in self.sizes)

    @property
    def ok(self) -> bool:
        return self.error is None and self.correct

    @property
    def cross_node(self) -> bool:
        return len(set(self.nodes)) > 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        status, detail, fix = assess_transport(self.transport, self.cross_node)
        data.update(ok=self.ok, correct=self.correct, assessment=None)
        if self.transport is not None:
            data["assessment"] = {"status": status, "detail": detail, "fix": fix}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveReport:
        """The report `to_json` wrote (its derived keys ignored): `doctor nccl --json` read
        back by `doctor -i` on an mp cluster."""
        names = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in names}
        values["sizes"] = tuple(SizeResult(**s) for s in data.get("sizes", ()))
        values["links"] = tuple(LinkResult(**link) for link in data.get("links", ()))
        for name in ("nodes", "stages", "failed_ranks", "nccl_lines"):
            values[name] = tuple(data.get(name, ()))
        return cls(**values)

    def raise_for_failure(self) -> None:
        if self.error is not None:
            kind = CollectiveTimeoutError if "timed out" in self.error else CollectiveError
            raise kind(self.error, self.hint)
        if not self.correct:
            wrong = ", ".join(format_bytes(s.size_bytes) for s in self.sizes if not s.correct)
            raise CollectiveError(
                f"the {self.backend} all-reduce returned wrong sums at {wrong}",
                "a rank computes or transmits corrupt data: check the devices and the network",
            )


def format_bytes(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n} B"


def merge_results(
    backend: str, nodes: Sequence[str], results: Sequence[RankResult]
) -> CollectiveReport:
    """One report from every rank's result: rank 0's times and links, every rank's sums."""
    results = sorted(results, key=lambda r: r.rank)
    wrong = {size for r in results for size in r.wrong_sizes}
    head = results[0]
    sizes = tuple(replace(s, correct=s.size_bytes not in wrong) for s in head.sizes)
    links = tuple(
        replace(link, src_node=nodes[link.src_rank], dst_node=nodes[link.dst_rank])
        for link in head.links
    )
    return CollectiveReport(
        backend=backend,
        world_size=len(nodes),
        nodes=tuple(nodes),
        sizes=sizes,
        links=links,
        transport=weakest(r.transport for r in results),
        nccl_lines=tuple(line for r in results for line in r.nccl_lines[:16]),
    )


def describe_stages(stages: Sequence[str | None], nodes: Sequence[str]) -> tuple[str, list[int]]:
    """Which ranks were behind when the check stopped: ('rank 2 (on n3) never started; ranks 0,
    1 waited in rendezvous', [2])."""

    def order(stage: str | None) -> int:
        return -1 if stage is None else STAGES.index(stage)

    def who(ranks: list[int]) -> str:
        label = "rank" if len(ranks) == 1 else "ranks"
        where = sorted({nodes[r] for r in ranks})
        return f"{label} {', '.join(map(str, ranks))} (on {', '.join(where)})"

    groups: dict[str | None, list[int]] = {}
    for rank, stage in enumerate(stages):
        groups.setdefault(stage, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: order(item[0]))
    behind_stage, behind = ordered[0]
    what = "never started" if behind_stage is None else f"stuck in {behind_stage}"
    if len(ordered) == 1:
        return f"all {who(behind)} {what}", behind
    rest = "; ".join(f"{who(ranks)} waited in {stage}" for stage, ranks in ordered[1:])
    return f"{who(behind)} {what}; {rest}", behind


def _timeout_hint(stage: str | None, master: str, backend: str) -> str:
    if stage in (None, "starting"):
        return (
            "its process or actor did not start in time: check the node's load, or raise --timeout"
        )
    if stage == "rendezvous":
        return (
            f"the rank cannot reach the master {master}: check its VLLM_HOST_IP, "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME and the firewall (llmctl doctor lists them)"
        )
    return (
        f"the ranks joined but {backend} traffic between them stalls: check that every node "
        "reaches every other on the interface of its VLLM_HOST_IP (ports are ephemeral), and "
        "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME"
    )


def failure_report(
    backend: str,
    nodes: Sequence[str],
    stages: Sequence[str | None],
    master: str,
    *,
    timeout_s: float | None = None,
    rank_error: tuple[int, str] | None = None,
) -> CollectiveReport:
    """The report of a check that did not complete: a timeout, or a rank that died or raised."""
    if rank_error is not None:
        rank, what = rank_error
        error = f"the {backend} all-reduce check failed: rank {rank} (on {nodes[rank]}) {what}"
        hint = _timeout_hint(stages[rank], master, backend)
        failed = [rank]
    else:
        text, failed = describe_stages(stages, nodes)
        error = f"the {backend} all-reduce check timed out after {timeout_s:g} s: {text}"
        hint = _timeout_hint(stages[failed[0]], master, backend)
    return CollectiveReport(
        backend=backend,
        world_size=len(nodes),
        nodes=tuple(nodes),
        error=error,
        hint=hint,
        stages=tuple(stages),
        failed_ranks=tuple(failed),
    )
