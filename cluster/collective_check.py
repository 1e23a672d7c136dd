"""The all-reduce sanity check of the troubleshooting docs: one rank, and the local driver.

One rank (`run_rank`) joins the world over `tcp://master:port`, warms up, times all_reduce at a
few sizes (4 B for latency, then MiBs for bandwidth), checks the sums, then measures each link
between rank 0 and every other rank with send/recv ping-pongs. Its RankResult and the gathered
CollectiveReport are in collective_report (bandwidths as nccl-tests define them).

With NCCL, the rank logs NCCL_DEBUG=TRACE to a file and reads back the transport NCCL chose
(nccl_log.parse_nccl_transport).

Two drivers gather the ranks' results into one CollectiveReport:
  run_local(world_size)  here: one process per rank on 127.0.0.1, like the mp executor's workers:
                         fresh interpreters on a socketpair, dying with this process.
  run_on_ray()           ray_doctor: one actor per alive node of the Ray cluster.
Both stop every rank (kill the processes, kill the actors and remove the group) on success,
failure or timeout; a timeout names the ranks that were behind and the stage they were in.

Protocol of a local rank process (Connection: framed pickles over one end of a socketpair):

    driver -> rank   ("job", RankJob)                        once
    rank -> driver   ("stage", rank, name)                   at each stage in STAGES order
                     ("result", rank, RankResult) | ("error", rank, message, traceback)

Torch is imported only inside a rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

from llmctl.cluster.collective_report import (
    CollectiveReport,
    LinkResult,
    MiB,
    RankResult,
    SizeResult,
    bus_bandwidth,
    failure_report,
    merge_results,
)
from llmctl.cluster.nccl_log import parse_nccl_channels, parse_nccl_transport, weakest
from llmctl.engine.errors import ConfigError
from llmctl.engine.executor.multiproc import describe_exit, die_with_parent, free_port

logger = logging.getLogger("llmctl")

SIZES = (4, 1 * MiB, 16 * MiB)  # bytes per all-reduce: latency, then bandwidth
LINK_BYTES = 4 * MiB
LATENCY_ITERS = 20
WARMUP_ITERS = 2
POLL_S = 0.5  # how often a driver looks at the ranks' progress and the deadline
_KILL_GRACE_S = 1.0


def iterations(size_bytes: int) -> int:
    """Timed repetitions per size: many for latency, few for bandwidth (2 cores, many ranks)."""
    if size_bytes <= 64 * 1024:
        return 50
    return 10 if size_bytes <= 2 * MiB else 5


# -- one rank ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankJob:
    rank: int
    world_size: int
    init_method: str  # tcp://master:port
    backend: str  # "gloo" or "nccl"
    timeout_s: float
    local_rank: int = 0  # the CUDA device index on its node (NCCL)
    sizes: tuple[int, ...] = SIZES
    log_dir: str | None = None  # where NCCL's log goes (a temporary directory if None)
    threads: int | None = None  # torch threads; None: torch's default for the machine


def run_rank(job: RankJob, on_stage: Callable[[str], None] = lambda _: None) -> RankResult:
    """Run the check as one rank; every rank of the world must call it with the same sizes."""
    on_stage("starting")
    log_path = None
    if job.backend == "nccl":
        log_path = Path(job.log_dir or tempfile.mkdtemp(prefix="llmctl-nccl-"))
        log_path = log_path / f"nccl.rank{job.rank}.log"
        # Read once, at NCCL's first call in this process: set before the process group exists.
        # Release builds log TRACE as INFO; the 'Channel ... via' lines are in INIT.
        os.environ["NCCL_DEBUG"] = "TRACE"
        os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,ENV,NET"
        os.environ["NCCL_DEBUG_FILE"] = str(log_path)
    import torch
    import torch.distributed as dist

    from llmctl.engine.distributed import parallel_state

    if job.threads is not None:
        torch.set_num_threads(job.threads)
    if job.backend == "nccl":
        torch.cuda.set_device(job.local_rank)
        device = torch.device("cuda", job.local_rank)
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")

        def sync() -> None:
            pass

    on_stage("rendezvous")
    parallel_state.init_distributed_environment(
        job.world_size, job.rank, job.init_method, job.backend, timeout_s=job.timeout_s
    )
    try:
        on_stage("warm-up")
        world = job.world_size
        for size in job.sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            for _ in range(WARMUP_ITERS):
                dist.all_reduce(buffer)
        sync()
        on_stage("all-reduce")
        sizes, wrong = [], []
        for size in job.sizes:
            if not _sum_is_exact(torch, dist, size, job.rank, world, device):
                wrong.append(size)
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            n = iterations(size)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(buffer)
            sync()
            elapsed = _slowest(torch, dist, time.perf_counter() - start, device)
            per_call = elapsed / n
            algbw = size / per_call / 1e9
            sizes.append(SizeResult(size, n, per_call * 1e6, algbw, bus_bandwidth(algbw, world)))
        on_stage("links")
        links = _links(torch, dist, job.rank, world, device, sync)
        dist.barrier()
        on_stage("done")
    finally:
        parallel_state.destroy_distributed_environment()
    transport, lines = None, ()
    if log_path is not None and log_path.exists():
        text = log_path.read_text(errors="replace")
        if job.log_dir is None:
            shutil.rmtree(log_path.parent, ignore_errors=True)
        transport = parse_nccl_transport(text)
        channels = parse_nccl_channels(text)
        links = tuple(
            replace(
                link,
                transport=weakest(
                    c.transport for c in channels if {c.src, c.dst} == {0, link.dst_rank}
                ),
            )
            for link in links
        )
        lines = tuple(
            line for line in text.splitlines() if " via " in line or "Using network" in line
        )
    return RankResult(
        rank=job.rank,
        node=socket.gethostname(),
        pid=os.getpid(),
        sizes=tuple(sizes),
        links=links,
        wrong_sizes=tuple(wrong),
        transport=transport,
        nccl_lines=lines[:64],
    )


def _sum_is_exact(torch, dist, size: int, rank: int, world: int, device) -> bool:
    """All-reduce rank + 1 + (i % 7) at every index i: the sum is exact in float32."""
    pattern = torch.arange(max(1, size // 4), device=device) % 7
    tensor = (pattern + (rank + 1)).to(torch.float32)
    dist.all_reduce(tensor)
    expected = (pattern * world + world * (world + 1) // 2).to(torch.float32)
    return bool(torch.equal(tensor, expected))


def _slowest(torch, dist, seconds: float, device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _links(torch, dist, rank: int, world: int, device, sync) -> tuple[LinkResult, ...]:
    """Rank 0 ping-pongs with each other rank in turn; the others wait their turn."""
    small = torch.zeros(1, dtype=torch.float32, device=device)
    large = torch.zeros(LINK_BYTES // 4, dtype=torch.float32, device=device)
    links = []
    for peer in range(1, world):
        if rank not in (0, peer):
            continue
        other = peer if rank == 0 else 0
        times = []
        for payload, n in ((small, LATENCY_ITERS), (large, iterations(LINK_BYTES))):
            for i in range(WARMUP_ITERS + n):
                if i == WARMUP_ITERS:
                    sync()
                    start = time.perf_counter()
                if rank == 0:  # 0 sends the payload, the peer answers with 4 bytes
                    dist.send(payload, other)
                    dist.recv(small, other)
                else:
                    dist.recv(payload, other)
                    dist.send(small, other)
            sync()
            times.append((time.perf_counter() - start) / n)
        if rank == 0:
            latency = times[0] / 2
            transfer = max(times[1] - latency, 1e-9)
            links.append(LinkResult(0, peer, latency * 1e6, LINK_BYTES / transfer / 1e9))
    return tuple(links)


# -- local driver: one process per rank -----------------------------------------------------------


def run_local(
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    *,
    sizes: Sequence[int] = SIZES,
    start_ranks: Iterable[int] | None = None,
) -> CollectiveReport:
    """The check with `world_size` processes on this machine (127.0.0.1).

    `timeout_s` bounds the whole run, process start-up included; at the deadline every rank is
    killed and the report names the ranks that were behind. `start_ranks` (for tests) starts
    only those ranks: the others never join.
    """
    _validate(world_size, backend, timeout_s)
    if backend == "nccl":
        _need_cuda(world_size)
    master = "127.0.0.1"
    init_method = f"tcp://{master}:{free_port()}"
    started = set(range(world_size) if start_ranks is None else start_ranks)
    host = socket.gethostname()
    nodes = [host] * world_size
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    deadline = time.monotonic() + timeout_s
    processes: dict[int, subprocess.Popen] = {}
    conns: dict[int, Connection] = {}
    sentinels: dict[int, int] = {}
    stages: list[str | None] = [None] * world_size
    results: dict[int, RankResult] = {}
    log_dir = tempfile.mkdtemp(prefix="llmctl-nccl-") if backend == "nccl" else None
    try:
        for rank in sorted(started):
            parent_end, child_end = socket.socketpair()
            processes[rank] = subprocess.Popen(
                [sys.executable, "-m", __name__, "--fd", str(child_end.fileno())],
                pass_fds=[child_end.fileno()],
                stdin=subprocess.DEVNULL,
            )
            child_end.close()
            sentinels[rank] = os.pidfd_open(processes[rank].pid)
            conns[rank] = Connection(parent_end.detach())
            job = RankJob(
                rank=rank,
                world_size=world_size,
                init_method=init_method,
                backend=backend,
                timeout_s=timeout_s,
                local_rank=rank,
                sizes=tuple(sizes),
                log_dir=log_dir,
                threads=threads,
            )
            conns[rank].send(("job", job))
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return failure_report(backend, nodes, stages, master, timeout_s=timeout_s)
            waiting = [r for r in started if r not in results]
            ready = wait(
                [conns[r] for r in waiting] + [sentinels[r] for r in waiting],
                timeout=min(remaining, POLL_S),
            )
            for rank in waiting:
                if conns[rank] in ready or sentinels[rank] in ready:
                    failure = _drain(rank, conns[rank], stages, results)
                    if failure is None and sentinels[rank] in ready and rank not in results:
                        failure = _exit_reason(processes[rank])
                    if failure is not None:
                        return failure_report(
                            backend, nodes, stages, master, rank_error=(rank, failure)
                        )
        return merge_results(backend, nodes, list(results.values()))
    finally:
        _stop(processes.values(), conns.values(), sentinels.values())
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


def _validate(world_size: int, backend: str, timeout_s: float) -> None:
    if world_size < 1:
        raise ConfigError(f"world size {world_size}", "use 1 or more ranks")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"unknown backend {backend!r}", "use gloo or nccl")
    if timeout_s <= 0:
        raise ConfigError(f"timeout {timeout_s:g} s", "use a positive number of seconds")


def local_backends(backend: str) -> list[str]:
    """The backends `auto` means on this machine: Gloo, then NCCL when CUDA is here."""
    if backend != "auto":
        _validate(1, backend, 1.0)
        return [backend]
    import torch

    return ["gloo"] + (["nccl"] if torch.cuda.is_available() else [])


def _need_cuda(world_size: int) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < world_size:
        raise ConfigError(
            f"the NCCL check needs {world_size} CUDA devices on this machine; it has {count}",
            "use --backend gloo, or fewer ranks (--world-size)",
        )


def _drain(rank: int, conn: Connection, stages: list, results: dict) -> str | None:
    """Read every waiting message of a rank; returns why it failed, if it says so."""
    try:
        while conn.poll():
            message = conn.recv()
            if message[0] == "stage":
                stages[rank] = message[2]
            elif message[0] == "result":
                results[rank] = message[2]
            elif message[0] == "error":
                logger.debug("rank %d raised:\n%s", rank, message[3])
                return f"raised {message[2]}"
    except (EOFError, OSError):
        pass
    return None


def _exit_reason(process: subprocess.Popen) -> str | None:
    """Why a rank whose sentinel fired stopped without a result; None if it has not exited."""
    try:
        process.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        return None
    return describe_exit(process.returncode)


def _stop(processes: Iterable[subprocess.Popen], conns: Iterable, sentinels: Iterable[int]) -> None:
    """Terminate every rank, kill the ones that linger, reap them all: no orphan survives."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for conn in conns:
        conn.close()
    for fd in sentinels:
        os.close(fd)


def _rank_main(fd: int) -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    _, job = conn.recv()

    def report_stage(name: str) -> None:
        conn.send(("stage", job.rank, name))

    try:
        result = run_rank(job, report_stage)
    except BaseException as exc:  # report why, then exit: the driver names this rank
        conn.send(("error", job.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return 1
    conn.send(("result", job.rank, result))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="llmctl all-reduce check rank (started by doctor)")
    parser.add_argument("--fd", type=int, required=True)
    fd = parser.parse_args().fd
    # Run the module under its import name, so results unpickle as llmctl's classes.
    from llmctl.cluster import collective_check

    sys.exit(collective_check._rank_main(fd))
