"""`llmctl plan` with data-parallel replicas: proposed when a layout fits in fewer GPUs than a node
has, asked with --data-parallel-size, and refused by name when the inventory cannot hold them."""

from __future__ import annotations

import json


def test_a_model_fitting_one_gpu_is_proposed_as_replicas(invoke):
    args = ("plan", "Llama-3.1-8B", "--gpus-per-node", "2", "--max-model-len", "8192")
    result = invoke(*args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    plan = json.loads(invoke(*args, "--json").stdout)
    per_replica, total = plan["kv_cache_tokens"], plan["total_kv_cache_tokens"]
    assert plan["data_parallel_size"] == 2 and total == 2 * per_replica
    assert plan["total_max_concurrency"] == round(2 * per_replica / 8192, 2)
    assert f"Per replica: {per_replica:,} KV tokens, maximum concurrency" in out
    assert f"In total (2 replicas, 2 GPUs): {total:,} KV tokens" in out
    why = out[out.index("Why") :]
    assert "fits one GPU of a node of 2: 2 data-parallel replicas" in why
    assert "serve about 2x the requests of one" in why
    assert out.rstrip().endswith(
        "llmctl serve Llama-3.1-8B --max-model-len 8192 --data-parallel-size 2"
    )


def test_asked_replicas_share_the_node(invoke):
    result = invoke(
        "plan", "Llama-3.1-70B", "--max-model-len", "8192", "-dp", "2", "--json"
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    # each replica gets 4 of the 8 GPUs; tp=2 is the smallest layout that fits them
    assert (plan["tensor_parallel_size"], plan["data_parallel_size"]) == (2, 2)
    assert plan["alternatives"][0]["layout"] == "tp=4, pp=1"  # a replica's share, full width
    assert plan["commands"]["serve"] == (
        "llmctl serve Llama-3.1-70B -tp 2 --distributed-executor-backend mp "
        "--max-model-len 8192 --data-parallel-size 2"
    )


def test_one_replica_asked_proposes_none(invoke):
    result = invoke("plan", "Llama-3.1-8B", "--gpus-per-node", "4", "-dp", "1", "--json")
    plan = json.loads(result.stdout)
    assert plan["data_parallel_size"] == 1
    assert "--data-parallel-size" not in plan["commands"]["serve"]


def test_more_replicas_than_a_node_holds_is_refused(invoke):
    result = invoke("plan", "GPT-2", "--gpus-per-node", "2", "--data-parallel-size", "4")
    assert result.exit_code == 1
    assert "data_parallel_size=4 replicas need 4 GPUs on one node, but a node of this " in (
        result.stderr
    )
    assert "use --data-parallel-size 2 or fewer" in result.stderr
    assert "or add nodes to the inventory" in result.stderr
    tp = invoke("plan", "Llama-3.1-70B", "-tp", "4", "-dp", "3")
    assert tp.exit_code == 1
    assert "replicas of tp=4, pp=1 need 12 GPUs" in tp.stderr
    assert "--data-parallel-size 2 or fewer" in tp.stderr


def test_replicas_of_a_model_too_big_for_their_share_are_refused(invoke):
    result = invoke(
        "plan", "Llama-3.1-70B", "--max-model-len", "8192", "--gpus-per-node", "4",
        "--gpu-memory-gib", "48", "-dp", "4",
    )  # fmt: skip
    assert result.exit_code == 1
    assert "data_parallel_size=4: one replica gets 1 of a node's 4 GPUs" in result.stderr
    assert "use --data-parallel-size 2 or fewer" in result.stderr
    # Two nodes of 8: -dp 4 puts 2 replicas of 4 GPUs on each, too few for 405B; -dp 2 fits.
    huge = invoke("plan", "Llama-3.1-405B", "--nodes", "2", "-dp", "4", "--json")
    assert huge.exit_code == 1
    error = json.loads(huge.stdout)["error"]
    assert "data_parallel_size=4: one replica gets 4 of a node's 8 GPUs" in error
    assert "use --data-parallel-size 2" in error
    whole = invoke("plan", "Llama-3.1-405B", "--nodes", "1", "-dp", "2", "--json")
    error = json.loads(whole.stdout)["error"]
    assert "drop --data-parallel-size: one replica needs more than a node's GPUs" in error


def test_a_bad_data_parallel_size_is_refused(invoke):
    result = invoke("plan", "GPT-2", "-dp", "0")
    assert result.exit_code == 1
    assert "data_parallel_size must be at least 1, got 0" in result.stderr


def test_a_second_node_gets_replicas_of_its_own(invoke):
    # The user: the model fits one node, and a second node has no other way to be used.
    args = ("plan", "Llama-3.1-8B", "--nodes", "2", "--gpus-per-node", "2", "--max-model-len")
    plan = json.loads(invoke(*args, "8192", "--json").stdout)
    assert plan["data_parallel_size"] == 4
    assert plan["total_kv_cache_tokens"] == 4 * plan["kv_cache_tokens"]
    head, other = plan["commands"]["serve"], plan["commands"]["serve_node_1"]
    common = (
        "llmctl serve Llama-3.1-8B --max-model-len 8192 --data-parallel-size 4 "
        "--data-parallel-size-local 2 "
    )
    assert head == common + (
        "--data-parallel-address 10.0.0.1 --data-parallel-rpc-port 29550  # on node0"
    )
    assert other == common + (
        "--data-parallel-start-rank 2 --data-parallel-address 10.0.0.1 "
        "--data-parallel-rpc-port 29550 --headless  # on node1"
    )
    assert any("2 on each of 2 nodes" in reason for reason in plan["reasons"])


def test_asked_replicas_spread_over_the_nodes_or_are_refused_by_name(invoke):
    spread = invoke("plan", "Llama-3.1-70B", "--nodes", "2", "--max-model-len", "8192", "-dp", "2",
                    "--json")  # fmt: skip
    plan = json.loads(spread.stdout)
    assert plan["data_parallel_size"] == 2 and plan["tensor_parallel_size"] <= 8
    assert "--data-parallel-size-local 1" in plan["commands"]["serve"]
    assert "--data-parallel-start-rank 1" in plan["commands"]["serve_node_1"]
    uneven = invoke("plan", "Llama-3.1-8B", "--nodes", "2", "--gpus-per-node", "2", "-dp", "3")
    assert uneven.exit_code == 1
    assert "do not divide evenly over this inventory's 2 nodes of 2 GPUs" in uneven.stderr
    assert "use --data-parallel-size 2 or 4" in uneven.stderr
    many = invoke("plan", "Llama-3.1-8B", "--nodes", "2", "--gpus-per-node", "2", "-dp", "6")
    assert many.exit_code == 1
    assert "need 6 GPUs, but this inventory's 2 nodes have 4" in many.stderr


def test_expert_parallel_replicas_print_ep_size_dp_x_tp(invoke):
    args = ("plan", "Mixtral-8x7B", "-tp", "2", "-dp", "2", "--max-model-len", "8192")
    result = invoke(*args, "--enable-expert-parallel", env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "Expert parallel across the replicas: EP size = DP x TP = 2 x 2 = 4" in result.stdout
    assert "experts 0-1 on EP rank 0, 2-3 on EP rank 1, 4-5 on EP rank 2, 6-7 on EP rank 3" in (
        result.stdout
    )
    assert "--enable-expert-parallel --data-parallel-size 2" in result.stdout
    plain = invoke(*args, env={"COLUMNS": "300"})
    assert "Expert parallel across" not in plain.stdout  # independent replicas: no EP


def test_expert_parallel_replicas_stay_on_one_node_or_are_refused_by_name(invoke):
    two_nodes = ("--gpus-per-node", "8", "--nodes", "2", "--max-model-len", "8192")
    one = invoke("plan", "Mixtral-8x7B", *two_nodes, "-tp", "4", "-dp", "2",
                 "--enable-expert-parallel", "--json")  # fmt: skip
    assert one.exit_code == 0, one.output
    serve = json.loads(one.stdout)["commands"]["serve"]
    assert serve.endswith("--enable-expert-parallel --data-parallel-size 2")  # no --headless
    staged = invoke("plan", "Mixtral-8x7B", "-tp", "2", "-pp", "2", "-dp", "2",
                    "--enable-expert-parallel")  # fmt: skip
    assert staged.exit_code == 1
    assert "does not support pipeline_parallel_size=2 yet" in staged.stderr
    too_many = invoke("plan", "Mixtral-8x7B", *two_nodes, "-tp", "4", "-dp", "4",
                      "--enable-expert-parallel")  # fmt: skip
    assert too_many.exit_code == 1
    assert "expert parallelism over 16 ranks exceeds the model's 8 experts" in too_many.stderr
