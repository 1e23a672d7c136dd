"""The Ray executor's CUDA_VISIBLE_DEVICES per rank: Ray shows each actor only its own GPU, and a
rank selects cuda:<local_rank>, so each rank must see its node's GPUs in local-rank order."""

from __future__ import annotations

from llmctl.engine.executor.ray import cuda_visible_devices


def test_each_rank_sees_its_nodes_gpus_in_local_rank_order():
    ips = ["10.0.0.1"] * 4 + ["10.0.0.2"] * 2
    gpu_ids = [["2"], ["0"], ["3"], ["1"], ["1"], ["0"]]
    visible = cuda_visible_devices(ips, gpu_ids)
    assert visible == ["2,0,3,1"] * 4 + ["1,0"] * 2
    # Local rank k selects the k-th visible GPU: Ray's own GPU for that rank.
    local = [0, 1, 2, 3, 0, 1]
    assert [v.split(",")[k] for v, k in zip(visible, local, strict=True)] == [
        ids[0] for ids in gpu_ids
    ]


def test_ranks_without_exactly_one_gpu_keep_rays_setting():
    assert cuda_visible_devices(["a", "a"], [["0"], []]) == [None, None]
    assert cuda_visible_devices(["a"], [["0", "1"]]) == [None]
