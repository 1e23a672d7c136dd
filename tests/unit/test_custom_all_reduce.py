"""When tensor-parallel ranks all-reduce through peer-mapped GPU memory, and when through NCCL
(engine/distributed/custom_all_reduce.py): decided from the ranks' hosts, GPUs, torch builds and
peer access, the same on every rank. (The all-reduce itself needs GPUs of one node: it checks
itself at set-up and falls back to NCCL if its sums are wrong.)"""

from __future__ import annotations

from llmctl.engine.distributed.custom_all_reduce import choose

HOSTS = ["node-a"] * 4
ALL_PEERS = lambda a, b: True  # noqa: E731


def test_gpus_of_one_node_with_peer_access_use_it():
    assert choose("cuda", HOSTS, [0, 1, 2, 3], ALL_PEERS, True, [True] * 4) is None


def test_every_other_case_keeps_nccl():
    cases = {
        "LLMCTL_CUSTOM_ALL_REDUCE=0": choose("cuda", HOSTS, [0, 1, 2, 3], ALL_PEERS, False),
        "not on CUDA": choose("cpu", HOSTS, [0, 1, 2, 3], ALL_PEERS, True),
        "one rank": choose("cuda", ["node-a"], [0], ALL_PEERS, True),
        "the ranks span nodes": choose(
            "cuda", ["node-a", "node-a", "node-b", "node-b"], [0, 1, 0, 1], ALL_PEERS, True
        ),
        "this torch has no symmetric memory": choose(
            "cuda", HOSTS, [0, 1, 2, 3], ALL_PEERS, True, [True, True, False, True]
        ),
        "GPU 0 cannot map GPU 3": choose(
            "cuda", HOSTS, [0, 1, 2, 3], lambda a, b: {a, b} != {0, 3}, True, [True] * 4
        ),
        "under one index": choose("cuda", HOSTS, [0, 0, 0, 0], ALL_PEERS, True, [True] * 4),
    }
    for reason, why in cases.items():
        assert why is not None and reason in why, (reason, why)
