"""Which global ranks each node runs across nodes (--nnodes), and the node options refused at
the edge (EngineArgs), before any process or socket: pure code."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.distributed.ranks import node_of, node_ranks
from llmctl.engine.errors import ConfigError

NODE = {"nnodes": 2, "master_addr": "10.0.0.1"}


def test_each_node_runs_whole_pipeline_stages():
    # tp=2 x pp=4 on 2 nodes: stages 0-1 on node 0, stages 2-3 on node 1.
    assert node_ranks(0, 2, 4, 2) == [0, 1, 2, 3]
    assert node_ranks(1, 2, 4, 2) == [4, 5, 6, 7]
    assert node_ranks(1, 2, 2, 1) == [1]
    assert node_ranks(0, 1, 2, 2) == [0, 1, 2, 3]  # one node: every rank
    assert [node_of(r, 2, 4, 2) for r in range(8)] == [0] * 4 + [1] * 4


def test_a_valid_node_layout_reaches_the_parallel_config():
    args = EngineArgs(
        tensor_parallel_size=2, pipeline_parallel_size=2, node_rank=1, headless=True, **NODE
    )
    pc = args.create_parallel_config()
    assert (pc.nnodes, pc.node_rank, pc.master_addr, pc.master_port) == (2, 1, "10.0.0.1", 29501)
    assert pc.ranks_per_node == 2


@pytest.mark.parametrize(
    "kwargs, message, hint",
    [
        ({"node_rank": 2, "headless": True}, "node_rank=2 is not a node of --nnodes 2", "0 to 1"),
        (
            {"tensor_parallel_size": 4},
            "4 ranks on 2 nodes would split a tensor-parallel group of 4",
            "e.g. -tp 2 -pp 2",
        ),
        (
            {"pipeline_parallel_size": 3},
            "3 ranks (tp=1 x pp=3) do not divide over 2 nodes",
            "--nnodes 1 or 3",
        ),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
            "--nnodes 2 runs on the mp backend, not 'ray'",
            "--distributed-executor-backend mp",
        ),
        (
            {"pipeline_parallel_size": 2, "master_addr": None},
            "--nnodes 2 needs --master-addr",
            "node 0's address",
        ),
        (
            {"pipeline_parallel_size": 2, "master_port": 65535},
            "master_port=65535",
            "--master-port 1024-65534",
        ),
        (
            {"pipeline_parallel_size": 2, "headless": True},
            "--headless runs no API server, but node rank 0 serves it",
            "drop --headless on node 0",
        ),
        (
            {"pipeline_parallel_size": 2, "node_rank": 1},
            "node rank 1 runs ranks for node 0",
            "add --headless",
        ),
    ],
)
def test_impossible_node_options_are_refused_with_the_fix(kwargs, message, hint):
    with pytest.raises(ConfigError) as err:
        EngineArgs(**{**NODE, **kwargs})
    assert message in err.value.message
    assert hint in err.value.hint


def test_headless_starts_no_engine_in_python():
    args = EngineArgs(pipeline_parallel_size=2, node_rank=1, headless=True, **NODE)
    with pytest.raises(ConfigError) as err:
        args.create_engine_config()
    assert "headless=True starts no engine" in err.value.message
    assert "--headless" in err.value.hint


def test_serve_refuses_a_node_layout_before_loading_anything():
    result = CliRunner().invoke(
        app, ["serve", "-tp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1"]
    )
    assert result.exit_code == 1
    assert "would split a tensor-parallel group of 2" in result.output
