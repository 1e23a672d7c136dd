"""The all-reduce sanity check on the engine's own workers: Gloo ranks on 127.0.0.1 started by the
mp executor, their sums, timings and links; a check that runs out of time names the ranks behind
and the timeout, with no process left behind."""

from __future__ import annotations

import json
import os

import pytest
from support import live_pids

from llmctl.cluster.doctor.collective_check import MiB, check_config, run_check, run_local
from llmctl.engine.errors import ConfigError
from llmctl.engine.executor.base import Executor
from llmctl.engine.executor.multiproc import MultiprocExecutor


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_measurements(report, world_size: int) -> None:
    assert report.ok, report.error
    assert report.world_size == world_size and report.backend == "gloo"
    assert [s.size_bytes for s in report.sizes] == [4, 1 * MiB, 16 * MiB]
    for size in report.sizes:
        assert size.correct
        assert size.time_us > 0 and size.algbw_gbps > 0
        assert size.busbw_gbps == pytest.approx(size.algbw_gbps * 2 * (world_size - 1) / world_size)
    assert [(link.src_rank, link.dst_rank) for link in report.links] == [
        (0, r) for r in range(1, world_size)
    ]
    for link in report.links:
        assert link.latency_us > 0 and link.bandwidth_gbps > 0


class RecordingExecutor(MultiprocExecutor):
    """The mp executor, recording each collective_rpc: the function and every rank's reply."""

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        replies = super().collective_rpc(method, args, kwargs, timeout)
        self.calls.append((getattr(method, "__name__", method), replies))
        return replies


def test_the_check_runs_through_the_mp_executors_worker_processes():
    before = live_pids(parent=os.getpid())
    config = check_config(2, "gloo", "mp")
    assert Executor.get_class(config) is MultiprocExecutor
    started = []

    def start(timeout: float):
        started.append(RecordingExecutor(config, start_timeout_s=timeout))
        started[0].calls = []
        workers = live_pids(parent=os.getpid()) - before
        assert set(started[0].pids) == workers and len(workers) == 2
        return started[0]

    report = run_check(start, "gloo", ["n0", "n0"], "127.0.0.1", 90)
    _check_measurements(report, 2)
    (executor,) = started
    assert [name for name, _ in executor.calls] == [
        "join",
        "warm_up",
        "time_all_reduce",
        "time_links",
    ]
    _, joined = executor.calls[0]
    assert [pid for _, pid in joined] == executor.pids  # one reply per worker process
    assert os.getpid() not in executor.pids
    assert executor.is_dead is False
    assert live_pids(parent=os.getpid()) - before == set()  # the executor stopped its workers


def test_gloo_all_reduce_on_two_ranks():
    _check_measurements(run_local(2, "gloo", timeout_s=90), 2)


def test_gloo_all_reduce_on_three_ranks():
    report = run_local(3, "gloo", timeout_s=90)
    _check_measurements(report, 3)
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_a_check_out_of_time_names_the_ranks_behind_and_leaves_no_process():
    before = live_pids(parent=os.getpid())
    # No interpreter imports torch within 10 ms: no rank starts in time.
    report = run_local(3, "gloo", timeout_s=0.01)
    assert not report.ok and report.failed_ranks == (0, 1, 2)
    assert report.error.startswith("the gloo all-reduce check timed out after 0.01 s: ")
    assert "all ranks 0, 1, 2" in report.error and "never started" in report.error
    assert "raise --timeout" in report.hint
    assert live_pids(parent=os.getpid()) - before == set()


def test_nccl_without_cuda_is_refused_with_a_hint():
    if _cuda_devices() >= 2:
        pytest.skip("this machine has CUDA devices: the NCCL check runs instead")
    with pytest.raises(ConfigError) as info:
        run_local(2, "nccl", timeout_s=30)
    assert "CUDA devices" in info.value.message and "--backend gloo" in info.value.hint


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_nccl_all_reduce_reports_its_transport():
    report = run_local(2, "nccl", timeout_s=120)
    assert report.ok, report.error
    assert report.transport is not None and report.nccl_lines
    assert all(link.transport for link in report.links)
