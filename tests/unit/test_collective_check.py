"""The all-reduce sanity check on real processes: Gloo ranks on 127.0.0.1, their sums, timings and
links; a rank that never joins ends in a timeout naming it, with no process left behind; and
`llmctl doctor` / `llmctl doctor nccl` as a user runs them."""

from __future__ import annotations

import json
import os
import time

import pytest
from support import live_pids

from llmctl.cluster.collective_check import MiB, run_local
from llmctl.engine.errors import ConfigError


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


def test_gloo_all_reduce_on_two_ranks():
    _check_measurements(run_local(2, "gloo", timeout_s=90), 2)


def test_gloo_all_reduce_on_three_ranks():
    report = run_local(3, "gloo", timeout_s=90)
    _check_measurements(report, 3)
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_a_rank_that_never_joins_times_out_naming_it_and_leaves_no_process():
    before = live_pids(parent=os.getpid())
    start = time.monotonic()
    report = run_local(3, "gloo", timeout_s=8, start_ranks=[0, 1])
    elapsed = time.monotonic() - start
    assert 8 <= elapsed < 8 + 5  # the deadline, plus at most the kill grace
    assert not report.ok and report.failed_ranks == (2,)
    assert report.error.startswith("the gloo all-reduce check timed out after 8 s: rank 2 ")
    assert "never started" in report.error
    assert report.hint
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
