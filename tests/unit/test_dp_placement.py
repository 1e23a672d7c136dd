"""DPPlacement, pure: which replicas a node runs and expects under vLLM's multi-node
data-parallel flags, and the typed errors for sizes that do not add up."""

from __future__ import annotations

import pytest

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.dp.placement import DEFAULT_RPC_PORT, DPPlacement
from llmctl.engine.errors import ConfigError

HEAD = "10.0.0.1"


def test_the_head_runs_the_first_replicas_and_expects_the_rest():
    head = DPPlacement(size=4, size_local=2, address=HEAD, rpc_port=13345)
    assert head.multi_node and not head.headless
    assert head.local_ranks == [0, 1] and head.remote_ranks == [2, 3]
    assert head.endpoint == "10.0.0.1:13345"
    api_only = DPPlacement(size=4, size_local=0, address=HEAD)
    assert api_only.local_ranks == [] and api_only.remote_ranks == [0, 1, 2, 3]
    assert api_only.port == DEFAULT_RPC_PORT  # vLLM's default


def test_a_headless_node_runs_its_ranks_and_expects_none():
    node = DPPlacement(size=4, size_local=2, start_rank=2, address=HEAD, headless=True)
    assert node.local_ranks == [2, 3] and node.remote_ranks == []
    assert DPPlacement(size=4, address=HEAD, headless=True).local_ranks == [0, 1, 2, 3]
    assert DPPlacement(size=2, address="fe80::1", rpc_port=7, headless=True).endpoint == (
        "[fe80::1]:7"
    )


def test_one_node_is_not_multi_node():
    one = DPPlacement(size=2)
    assert not one.multi_node and one.local_ranks == [0, 1] and one.remote_ranks == []
    # all replicas local: the address changes nothing (vLLM accepts it too)
    assert not DPPlacement(size=2, size_local=2, address=HEAD).multi_node


@pytest.mark.parametrize(
    "kwargs, message, hint",
    [
        ({"size": 2, "size_local": 1},
         "--data-parallel-size-local 1 of --data-parallel-size 2 places replicas on several "
         "nodes, but no head address is given", "add --data-parallel-address"),
        ({"size": 2, "headless": True},
         "--headless with --data-parallel-size places replicas on several nodes", "head's IP"),
        ({"size": 2, "size_local": 3, "address": HEAD},
         "--data-parallel-size-local 3 is more than --data-parallel-size 2",
         "--data-parallel-size-local 2 or less"),
        ({"size": 2, "size_local": -1, "address": HEAD},
         "--data-parallel-size-local must be 0 or more, got -1", "replicas this node runs"),
        ({"size": 4, "size_local": 2, "start_rank": 3, "address": HEAD, "headless": True},
         "replicas 3 to 4 (--data-parallel-start-rank 3, --data-parallel-size-local 2) are not "
         "all ranks of --data-parallel-size 4 (0 to 3)", "must add up to --data-parallel-size"),
        ({"size": 4, "size_local": 1, "start_rank": -1, "address": HEAD, "headless": True},
         "replicas -1 to -1", "start rank"),
        ({"size": 4, "size_local": 2, "start_rank": 2, "address": HEAD},
         "--data-parallel-start-rank 2 on the head: the head runs replicas 0 to 1",
         "only to the --headless nodes"),
        ({"size": 2, "size_local": 0, "address": HEAD, "headless": True},
         "--headless with --data-parallel-size-local 0 runs nothing", "1 or more"),
        ({"size": 2, "size_local": 1, "address": HEAD, "rpc_port": 0},
         "--data-parallel-rpc-port must be a TCP port, got 0", "29550"),
        ({"size": 2, "nnodes": 2},
         "--data-parallel-size with --nnodes: multi-node data parallel is not yet supported "
         "with replicas whose ranks span nodes", "--data-parallel-size-local with"),
    ],
)  # fmt: skip
def test_sizes_that_do_not_add_up_are_refused_by_name(kwargs, message, hint):
    with pytest.raises(ConfigError) as err:
        DPPlacement(**kwargs)
    assert message in err.value.message
    assert hint in err.value.hint


def test_the_hint_for_a_missing_node_is_its_command_line():
    head = DPPlacement(size=4, size_local=1, address=HEAD, rpc_port=13345)
    assert head.headless_argv(1, 3) == [
        "-dp", "4", "--data-parallel-size-local", "3", "--data-parallel-start-rank", "1",
        "--data-parallel-address", HEAD, "--data-parallel-rpc-port", "13345", "--headless",
    ]  # fmt: skip


def test_engine_args_tell_a_data_parallel_headless_node_from_an_nnodes_one():
    dp = EngineArgs(
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_start_rank=1,
        data_parallel_address=HEAD,
        headless=True,
    )
    assert dp.data_parallel_placement().headless
    assert dp.data_parallel_placement().local_ranks == [1]
    # --headless with --nnodes is the mp group's (node ranks > 0), no data parallel
    nodes = EngineArgs(
        pipeline_parallel_size=2, nnodes=2, node_rank=1, master_addr=HEAD, headless=True
    )
    assert not nodes.data_parallel_placement().headless
    # ... and a plain --headless on node rank 0 is still refused by name
    with pytest.raises(ConfigError, match="--headless runs no API server"):
        EngineArgs(headless=True)
