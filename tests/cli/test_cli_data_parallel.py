"""`generate`/`serve` with data-parallel flags: -dp runs replicas; vLLM's multi-node flags are
checked before any model loads (sizes that do not add up, a missing head address), and the
head and a headless node name what is missing when they cannot meet."""

from __future__ import annotations

import json
import os

import pytest
from support import live_pids

from llmctl.engine.distributed.ports import free_port


def test_generate_with_two_replicas_matches_one(invoke, tiny_llama):
    common = ("generate", tiny_llama, "-p", "Hello", "-p", "The capital of France is",
              "--max-tokens", "6", "--dtype", "float32", "--kv-cache-space-gib", "0.02",
              "--json")  # fmt: skip
    one = invoke(*common)
    two = invoke(*common, "-dp", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert json.loads(two.stdout) == json.loads(one.stdout)


ADDRESS = ("--data-parallel-address", "127.0.0.1")


@pytest.mark.parametrize(
    "flags, message, hint",
    [
        (("-dp", "2", "-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"),
         "--data-parallel-size with --nnodes: multi-node data parallel is not yet supported",
         "--data-parallel-size N alone"),
        (("-dp", "2", "--data-parallel-size-local", "1"),
         "--data-parallel-size-local 1 of --data-parallel-size 2 places replicas on several "
         "nodes, but no head address is given", "add --data-parallel-address"),
        (("-dp", "2", "--data-parallel-size-local", "3", *ADDRESS),
         "--data-parallel-size-local 3 is more than --data-parallel-size 2",
         "use --data-parallel-size-local 2 or less"),
        (("-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "3",
          *ADDRESS, "--headless"),
         "replicas 3 to 4 (--data-parallel-start-rank 3, --data-parallel-size-local 2) are not "
         "all ranks of --data-parallel-size 4 (0 to 3)", "must add up to --data-parallel-size"),
        (("-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
          *ADDRESS),
         "--data-parallel-start-rank 1 on the head: the head runs replicas 0 to 0",
         "only to the --headless nodes"),
        (("-dp", "2", "--data-parallel-size-local", "0", *ADDRESS, "--headless"),
         "--headless with --data-parallel-size-local 0 runs nothing",
         "--data-parallel-size-local 1 or more"),
        (("-dp", "2", "--data-parallel-size-local", "1", *ADDRESS,
          "--data-parallel-rpc-port", "70000"),
         "--data-parallel-rpc-port must be a TCP port, got 70000", "use a free port"),
    ],
)  # fmt: skip
def test_multi_node_data_parallel_flags_are_checked_before_any_model_loads(
    invoke, tiny_llama, flags, message, hint
):
    result = invoke("serve", tiny_llama, *flags)
    assert result.exit_code == 1
    assert f"error: {message}" in result.stderr
    assert hint in result.stderr


def test_a_headless_node_names_the_head_it_cannot_reach(invoke, tiny_llama):
    port = free_port()  # nothing listens there
    result = invoke("serve", tiny_llama, "-dp", "2", "--data-parallel-size-local", "1",
                    "--data-parallel-start-rank", "1", *ADDRESS, "--data-parallel-rpc-port",
                    str(port), "--headless", "--rendezvous-timeout", "1")  # fmt: skip
    assert result.exit_code == 1
    assert (
        f"error: data-parallel replica 1 could not reach the head at 127.0.0.1:{port} within 1 s"
        in result.stderr
    )
    assert "Connection refused" in result.stderr
    assert f"--data-parallel-rpc-port {port}" in result.stderr  # how to start the head


def test_a_head_names_the_replicas_that_never_joined(invoke, tiny_llama):
    port = free_port()
    before = live_pids(parent=os.getpid())
    result = invoke("serve", tiny_llama, "--dtype", "float32", "--kv-cache-space-gib", "0.02",
                    "-dp", "3", "--data-parallel-size-local", "1", *ADDRESS,
                    "--data-parallel-rpc-port", str(port), "--rendezvous-timeout", "1")  # fmt: skip
    assert result.exit_code == 1
    assert (
        f"error: data-parallel replica(s) [1, 2] of 3 did not join the head at 127.0.0.1:{port} "
        "within 1 s (joined: none; the head runs [0])" in result.stderr
    )
    assert "--data-parallel-start-rank 1" in result.stderr and "--headless" in result.stderr
    # the head's own replica is stopped: no worker process is left
    assert live_pids(parent=os.getpid()) <= before


def test_replicas_on_the_uni_backend_are_refused(invoke, tiny_llama):
    result = invoke("generate", tiny_llama, "-p", "x", "-dp", "2",
                    "--distributed-executor-backend", "uni")  # fmt: skip
    assert result.exit_code == 1
    assert "data_parallel_size=2 runs each replica in its own worker processes" in result.stderr
    assert "use --distributed-executor-backend mp" in result.stderr


def test_replicas_on_an_mp_cluster_are_refused_before_any_connection(invoke, tmp_path):
    """On a cluster, Ray places replicas (tests/e2e/cluster/test_serve_on_cluster.py); the mp
    backend's group is one engine across the nodes."""
    inventory = tmp_path / "cluster.yaml"
    inventory.write_text("name: t\nnodes:\n  - {host: 10.255.0.1, head: true, gpus: 2}\n")
    result = invoke("serve", "-i", str(inventory), "-dp", "2", "--backend", "mp")
    assert result.exit_code == 1
    assert "--data-parallel-size 2 with -i on the mp backend" in result.stderr
    assert "Ray places each replica's workers" in result.stderr
    assert "llmctl plan -i ... -dp 2" in result.stderr
