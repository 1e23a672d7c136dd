"""Shared-memory collectives between real processes: sums, uneven gathers, many calls in a row,
and the fallback to Gloo for tensors larger than a slot."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmctl.engine.distributed.parallel_state import GroupCoordinator
from llmctl.engine.distributed.ports import free_port
from llmctl.engine.distributed.shm_communicator import ShmCommunicator


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    group = dist.new_group(list(range(world)))
    coordinator = GroupCoordinator(list(range(world)), rank, group, group)
    coordinator.shm = ShmCommunicator(group, rank, world, capacity=64 * 1024)
    out = {}
    # 1. Many all-reduces in a row (both buffers reused), in two dtypes.
    sums = []
    for step in range(50):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(7, 33, generator=g)
        sums.append(coordinator.all_reduce(x.clone()))
    out["sums"] = torch.stack(sums)
    xb = torch.full((4, 8), float(rank + 1), dtype=torch.bfloat16)
    out["bf16"] = coordinator.all_reduce(xb)
    # 2. Uneven gather along the last dimension (like vocabulary shards of the logits).
    sizes = [5, 4, 4][:world]
    shard = torch.full((3, sizes[rank]), float(rank))
    out["gather"] = coordinator.gather(shard, dim=-1, sizes=sizes)
    # 3. Larger than a 64 KiB slot: falls back to Gloo, same result.
    big = torch.full((128, 256), float(rank))
    out["big"] = coordinator.all_reduce(big)
    results[rank] = out
    coordinator.shm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives(world):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(world, free_port(), results), nprocs=world, join=True)
    for step in range(50):
        expected = sum(
            torch.randn(7, 33, generator=torch.Generator().manual_seed(1000 * step + r))
            for r in range(world)
        )
        for rank in range(world):
            assert torch.allclose(results[rank]["sums"][step], expected, atol=1e-5)
    # Every rank holds bitwise the same sums (ranks summed in the same order).
    for rank in range(1, world):
        assert torch.equal(results[rank]["sums"], results[0]["sums"])
    assert torch.equal(
        results[0]["bf16"],
        torch.full((4, 8), float(world * (world + 1) // 2), dtype=torch.bfloat16),
    )
    gathered = results[0]["gather"]
    sizes = [5, 4, 4][:world]
    assert gathered.shape == (3, sum(sizes))
    expected_row = [float(r) for r, n in enumerate(sizes) for _ in range(n)]
    assert gathered[0].tolist() == expected_row
    assert all(results[r]["gather"] is None for r in range(1, world))
    assert torch.equal(results[0]["big"], torch.full((128, 256), float(sum(range(world)))))
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("llmctl-")]
    assert leftovers == []  # the file was unlinked once every rank had mapped it
