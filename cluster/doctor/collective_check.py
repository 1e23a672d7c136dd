"""The all-reduce sanity check of the troubleshooting docs, run on the engine's own workers.

The executors start bare workers (an EngineConfig without a model): `run_local` one process per
rank on 127.0.0.1 (the mp executor), ray_doctor one Ray actor per node (the Ray executor). The
check then runs on them through `collective_rpc`, one step per stage (collective_report.STAGES):

    rendezvous   `join`: NCCL's log switched on, then the worker's own init_device
    warm-up      `warm_up`: a few all-reduces at every size
    all-reduce   `time_all_reduce`: the sums checked, then all_reduce timed at a few sizes
                 (4 B for latency, then MiBs for bandwidth)
    links        `time_links`: rank 0 ping-pongs with every other rank over send/recv

RankResult and the gathered CollectiveReport are in collective_report (bandwidths as nccl-tests
define them). With NCCL, each rank logs NCCL_DEBUG=TRACE to a file and reads back the transport
NCCL chose (nccl_log.parse_nccl_transport).

`timeout_s` bounds the whole check, the workers' start included. A step that a rank does not
finish in time, or that kills a rank or raises on it, ends the check: the executor stops every
worker (its processes, or its actors), and the report names the ranks that
were behind and their stage (ranks that finished a step wait in the next one), or the rank that
failed. Torch is imported only on the workers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmctl.cluster.doctor.collective_report import (
    CollectiveReport,
    LinkResult,
    MiB,
    RankResult,
    SizeResult,
    bus_bandwidth,
    failure_report,
    merge_results,
)
from llmctl.cluster.doctor.nccl_log import parse_nccl_channels, parse_nccl_transport, weakest
from llmctl.engine.errors import ConfigError, WorkerError, WorkerTimeoutError

SIZES = (4, 1 * MiB, 16 * MiB)  # bytes per all-reduce: latency, then bandwidth
LINK_BYTES = 4 * MiB
LATENCY_ITERS = 20
WARMUP_ITERS = 2


def iterations(size_bytes: int) -> int:
    """Timed repetitions per size: many for latency, few for bandwidth (2 cores, many ranks)."""
    if size_bytes <= 64 * 1024:
        return 50
    return 10 if size_bytes <= 2 * MiB else 5


# -- the steps, each run on every worker by collective_rpc (the worker comes first) --------------


def join(worker: Any, log_dir: str | None) -> tuple[str, int]:
    """Join the world through the worker's init_device (Gloo on the CPU, NCCL on CUDA); returns
    this rank's node and pid. With NCCL, its log goes to `log_dir` (a temporary directory if
    None)."""
    if worker.config.device_config.device == "cuda":
        log_path = Path(log_dir or tempfile.mkdtemp(prefix="llmctl-nccl-"))
        # Read once, at NCCL's first call in this process: set before the process group exists.
        # Release builds log TRACE as INFO; the 'Channel ... via' lines are in INIT.
        os.environ["NCCL_DEBUG"] = "TRACE"
        os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,ENV,NET"
        os.environ["NCCL_DEBUG_FILE"] = str(log_path / f"nccl.rank{worker.rank}.log")
    worker.init_device()
    if worker.config.parallel_config.world_size == 1:  # init_device joins no world of one
        from llmctl.engine.distributed import parallel_state

        backend = "nccl" if worker.config.device_config.device == "cuda" else "gloo"
        parallel_state.init_distributed_environment(1, 0, worker.distributed_init_method, backend)
    return socket.gethostname(), os.getpid()


def _device(worker: Any) -> tuple[Any, Callable[[], None]]:
    import torch

    if worker.config.device_config.device == "cuda":
        return torch.device("cuda", worker.local_rank), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


def warm_up(worker: Any, sizes: Sequence[int]) -> None:
    import torch
    import torch.distributed as dist

    device, sync = _device(worker)
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        for _ in range(WARMUP_ITERS):
            dist.all_reduce(buffer)
    sync()


def time_all_reduce(
    worker: Any, sizes: Sequence[int]
) -> tuple[tuple[SizeResult, ...], tuple[int, ...]]:
    """Each size's timing (the slowest rank's), and the sizes whose sum was wrong on this rank."""
    import torch
    import torch.distributed as dist

    device, sync = _device(worker)
    rank, world = dist.get_rank(), dist.get_world_size()
    results, wrong = [], []
    for size in sizes:
        if not _sum_is_exact(torch, dist, size, rank, world, device):
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
        results.append(SizeResult(size, n, per_call * 1e6, algbw, bus_bandwidth(algbw, world)))
    return tuple(results), tuple(wrong)


def time_links(
    worker: Any, log_dir: str | None
) -> tuple[tuple[LinkResult, ...], str | None, tuple[str, ...]]:
    """Rank 0's links (empty on the others), and with NCCL the transport this rank's log names,
    each link's transport and the log's transport lines. Removes a log not in `log_dir`."""
    import torch
    import torch.distributed as dist

    device, sync = _device(worker)
    links = _links(torch, dist, dist.get_rank(), dist.get_world_size(), device, sync)
    dist.barrier()
    log_file = os.environ.get("NCCL_DEBUG_FILE")
    if worker.config.device_config.device != "cuda" or not log_file:
        return links, None, ()
    log_path = Path(log_file)
    if not log_path.exists():
        return links, None, ()
    text = log_path.read_text(errors="replace")
    if log_dir is None:
        shutil.rmtree(log_path.parent, ignore_errors=True)
    channels = parse_nccl_channels(text)
    links = tuple(
        dataclasses.replace(
            link,
            transport=weakest(
                c.transport for c in channels if {c.src, c.dst} == {0, link.dst_rank}
            ),
        )
        for link in links
    )
    lines = tuple(line for line in text.splitlines() if " via " in line or "Using network" in line)
    return links, parse_nccl_transport(text), lines[:64]


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


# -- the driver: the steps in order, on workers an executor started ------------------------------


def run_check(
    start: Callable[[float], Any],
    backend: str,
    nodes: Sequence[str],
    master: str,
    timeout_s: float,
    *,
    sizes: Sequence[int] = SIZES,
    log_dir: str | None = None,
) -> CollectiveReport:
    """The check on the bare workers `start(timeout_s)` returns (an Executor, rank i on
    `nodes[i]`); every worker is stopped at the end, however it ends."""
    world = len(nodes)
    deadline = time.monotonic() + timeout_s

    def failed(exc: Exception, stage: str | None, next_stage: str) -> CollectiveReport:
        if isinstance(exc, WorkerTimeoutError):
            stages = [stage if r in exc.pending_ranks else next_stage for r in range(world)]
            return failure_report(backend, nodes, stages, master, timeout_s=timeout_s)
        stages = [stage] * world
        return failure_report(backend, nodes, stages, master, rank_error=(exc.rank, exc.reason))

    try:
        executor = start(timeout_s)
    except (WorkerError, WorkerTimeoutError) as exc:
        return failed(exc, None, "rendezvous")
    steps = (  # (stage, the step, its arguments), in STAGES order
        ("rendezvous", join, (log_dir,)),
        ("warm-up", warm_up, (tuple(sizes),)),
        ("all-reduce", time_all_reduce, (tuple(sizes),)),
        ("links", time_links, (log_dir,)),
    )
    try:
        replies: list[list] = []
        for i, (stage, step, args) in enumerate(steps):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                replies.append(executor.collective_rpc(step, args, timeout=remaining))
            except (WorkerError, WorkerTimeoutError) as exc:
                next_stage = steps[i + 1][0] if i + 1 < len(steps) else "done"
                return failed(exc, stage, next_stage)
    finally:
        executor.shutdown()
    results = [
        RankResult(
            rank=rank,
            node=node,
            pid=pid,
            sizes=timed[0],
            links=linked[0],
            wrong_sizes=timed[1],
            transport=linked[1],
            nccl_lines=linked[2],
        )
        for rank, ((node, pid), _, timed, linked) in enumerate(zip(*replies, strict=True))
    ]
    return merge_results(backend, nodes, results)


def check_config(
    world_size: int,
    backend: str,
    executor_backend: str,
    placement_group=None,
    *,
    nodes: dict | None = None,
):
    """The EngineConfig of a world of bare workers: no model; Gloo on the CPU, NCCL on CUDA.
    One pipeline stage per rank, so ranks may sit on different nodes (tensor-parallel groups
    may not). `nodes`: the mp backend across nodes (ParallelConfig's nnodes, master_addr, ...)."""
    from llmctl.engine.config.engine_config import (
        CacheConfig,
        DeviceConfig,
        EngineConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model_config=None,
        cache_config=CacheConfig(),
        scheduler_config=SchedulerConfig(),
        parallel_config=ParallelConfig(
            pipeline_parallel_size=world_size,
            distributed_executor_backend=executor_backend,
            placement_group=placement_group,
            **(nodes or {}),
        ),
        device_config=DeviceConfig("cuda" if backend == "nccl" else "cpu"),
    )


def start_workers(config, timeout_s: float):
    """The executor its config names (mp or Ray) with bare workers started within `timeout_s`."""
    from llmctl.engine.executor.base import Executor

    return Executor.get_class(config)(config, start_timeout_s=timeout_s)


def run_local(
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    *,
    sizes: Sequence[int] = SIZES,
    nnodes: int = 1,
    master_addr: str | None = None,
    master_port: int = 29501,
    cluster_secret_file: str | None = None,
    insecure_join: bool = False,
) -> CollectiveReport:
    """The check with `world_size` worker processes on this machine (the mp executor); with
    `nnodes` > 1, this is node 0 and ranks run on every node: each other node runs `llmctl serve
    --headless -pp WORLD_SIZE --nnodes N --node-rank R --master-addr A --master-port P`."""
    from llmctl.engine.distributed.ranks import node_of

    _validate(world_size, backend, timeout_s)
    if backend == "nccl":
        _need_cuda(world_size // max(1, nnodes))
    node_options = {}
    if nnodes != 1:
        node_options = dict(
            nnodes=nnodes,
            master_addr=master_addr,
            master_port=master_port,
            rendezvous_timeout=timeout_s,
            cluster_secret_file=cluster_secret_file,
            insecure_join=insecure_join,
        )
    config = check_config(world_size, backend, "mp", nodes=node_options)
    host = socket.gethostname()
    nodes = [
        host if (n := node_of(r, nnodes, world_size, 1)) == 0 else f"node {n}"
        for r in range(world_size)
    ]
    log_dir = tempfile.mkdtemp(prefix="llmctl-nccl-") if backend == "nccl" else None
    try:
        return run_check(
            functools.partial(start_workers, config),
            backend,
            nodes,
            master_addr or "127.0.0.1",
            timeout_s,
            sizes=sizes,
            log_dir=log_dir,
        )
    finally:
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
