"""`generate`/`serve` with data-parallel flags: -dp runs replicas; vLLM's multi-node flags are
refused by name (not yet supported), before any model loads."""

from __future__ import annotations

import json

import pytest


def test_generate_with_two_replicas_matches_one(invoke, tiny_llama):
    common = ("generate", tiny_llama, "-p", "Hello", "-p", "The capital of France is",
              "--max-tokens", "6", "--dtype", "float32", "--kv-cache-space-gib", "0.02",
              "--json")  # fmt: skip
    one = invoke(*common)
    two = invoke(*common, "-dp", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert json.loads(two.stdout) == json.loads(one.stdout)


@pytest.mark.parametrize(
    "flags, named",
    [
        (("-dp", "2", "-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"),
         "--data-parallel-size with --nnodes"),
        (("-dp", "2", "--data-parallel-size-local", "1"), "--data-parallel-size-local"),
        (("--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345"),
         "--data-parallel-address, --data-parallel-rpc-port"),
    ],
)  # fmt: skip
def test_multi_node_data_parallel_flags_are_refused_by_name(invoke, tiny_llama, flags, named):
    result = invoke("serve", tiny_llama, *flags)
    assert result.exit_code == 1
    assert f"error: {named}: multi-node data parallel is not yet supported" in result.stderr
    assert "--data-parallel-size N alone" in result.stderr


def test_replicas_on_the_uni_backend_are_refused(invoke, tiny_llama):
    result = invoke("generate", tiny_llama, "-p", "x", "-dp", "2",
                    "--distributed-executor-backend", "uni")  # fmt: skip
    assert result.exit_code == 1
    assert "data_parallel_size=2 runs each replica in its own worker processes" in result.stderr
    assert "use --distributed-executor-backend mp" in result.stderr


def test_replicas_on_a_cluster_are_refused_before_any_connection(invoke, tmp_path):
    inventory = tmp_path / "cluster.yaml"
    inventory.write_text("name: t\nnodes:\n  - {host: 10.255.0.1, head: true, gpus: 2}\n")
    result = invoke("serve", "-i", str(inventory), "-dp", "2")
    assert result.exit_code == 1
    assert "--data-parallel-size with -i is not yet supported" in result.stderr
    assert "run `llmctl serve -dp N` on one node" in result.stderr
