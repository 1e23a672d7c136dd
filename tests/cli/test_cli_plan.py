"""`llmctl plan` as a user runs it: tables, JSON, inventory files and errors."""

from __future__ import annotations

import json

from llmctl.cluster.plan.catalog import CATALOG


def test_list_models_shows_the_catalog(invoke):
    result = invoke("plan", "--list-models", "--json")
    assert result.exit_code == 0
    names = [row["name"] for row in json.loads(result.stdout)]
    assert names == list(CATALOG)
    for required in ("Llama-3.1-405B", "Mixtral-8x7B", "Qwen2.5-72B", "OPT-13B", "GPT-2"):
        assert required in names


def test_json_plan_for_two_nodes(invoke):
    result = invoke("plan", "Llama-3.1-405B", "--nodes", "2", "--max-model-len", "8192", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert (plan["tensor_parallel_size"], plan["pipeline_parallel_size"]) == (8, 2)
    assert plan["nodes_used"] == 2 and plan["gpus_used"] == 16
    assert sum(plan["layer_partition"]) == 126
    assert plan["kv_cache_tokens"] == plan["num_kv_blocks"] * plan["block_size"]
    assert plan["max_concurrency"] == round(plan["kv_cache_tokens"] / 8192, 2)
    assert plan["distributed_executor_backend"] == "ray"
    assert plan["commands"]["cluster_up"].startswith("llmctl cluster up -i")


def test_table_output_has_the_engine_lines_and_commands(invoke):
    result = invoke("plan", "Llama-3.1-70B", "--max-model-len", "8192", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "tensor_parallel_size=2" in out
    assert "# KV cache blocks:" in out and "KV cache size:" in out
    assert "Maximum concurrency for 8,192 tokens per request:" in out
    assert "Why" in out and "Rejected" in out
    assert "llmctl serve Llama-3.1-70B -tp 2 --distributed-executor-backend mp" in out


def test_inventory_file(invoke, tmp_path):
    inventory = tmp_path / "cluster.yaml"
    inventory.write_text(
        "name: t\nnodes:\n  - {host: 10.0.0.1, gpus: 4, gpu_memory_gib: 48, interconnect: pcie}\n"
    )
    result = invoke(
        "plan", "Llama-2-70B", "-i", str(inventory), "--max-model-len", "4096", "--json"
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert (plan["tensor_parallel_size"], plan["pipeline_parallel_size"]) == (1, 4)


def test_malformed_inventory_names_line_and_key(invoke, tmp_path):
    inventory = tmp_path / "cluster.yaml"
    inventory.write_text("name: t\nnodes:\n  - {host: 10.0.0.1, gpus: 4, gpu_mem: 48}\n")
    result = invoke("plan", "GPT-2", "-i", str(inventory))
    assert result.exit_code == 1
    assert f"error: {inventory} line 3, nodes[0].gpu_mem: unknown key" in result.stderr
    assert "gpu_memory_gib" in result.stderr


def test_too_big_exits_non_zero(invoke):
    result = invoke("plan", "Llama-3.1-405B", "--gpus-per-node", "2", "--gpu-memory-gib", "24")
    assert result.exit_code == 1
    assert "more memory is needed" in result.stderr
    as_json = invoke("plan", "Llama-3.1-405B", "--gpus-per-node", "2", "--json")
    assert as_json.exit_code == 1
    assert "more memory is needed" in json.loads(as_json.stdout)["error"]


def test_local_model_directory(invoke, tiny_models):
    result = invoke("plan", str(tiny_models.path("gpt2")), "--gpus-per-node", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tensor_parallel_size"] == 1


def test_unknown_model(invoke):
    result = invoke("plan", "Llama-9-1T")
    assert result.exit_code == 1
    assert "--list-models" in result.stderr


def test_uneven_tp_is_printed_as_llmctl_only(invoke):
    result = invoke(
        "plan", "Llama-3.1-8B", "--gpus-per-node", "3", "--max-model-len", "4096",
        env={"COLUMNS": "300"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout
    also = out[out.index("Also possible") :]
    assert "- tp=3, pp=1 (llmctl only): the node's full width" in also
    assert "KV heads 3,3,2 (query heads 12,12,8) per rank" in also
    assert "vLLM cannot run it" in also
    as_json = json.loads(invoke("plan", "Llama-3.1-8B", "--gpus-per-node", "3", "--json").stdout)
    assert as_json["alternatives"][0]["layout"] == "tp=3, pp=1 (llmctl only)"


def test_a_model_too_big_in_float_is_planned_quantized(invoke):
    result = invoke(
        "plan", "Llama-2-13B", "--gpus-per-node", "1", "--gpu-memory-gib", "24",
        env={"COLUMNS": "300"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "weights: 13.90 GiB per GPU (int8)" in out
    why = out[out.index("Why") : out.index("Also possible")]
    assert "- too big in float16: Llama-2-13B does not fit 1 node(s) x 1 GPU(s) of 24 GiB" in why
    assert "- so weight-only int8 quantization (--quantization int8)" in why
    also = out[out.index("Also possible") : out.index("Run")]
    assert "- tp=1, pp=1 with --quantization int4: the linear layers in 4-bit groups" in also
    assert out.rstrip().endswith("llmctl serve Llama-2-13B --quantization int8")
    as_json = invoke(
        "plan", "Llama-2-13B", "--gpus-per-node", "1", "--gpu-memory-gib", "24",
        "--quantization", "int4", "--json",
    )  # fmt: skip
    plan = json.loads(as_json.stdout)
    assert (plan["quantization"], plan["weight_format"]) == ("int4", "int4")
    assert plan["commands"]["serve"] == "llmctl serve Llama-2-13B --quantization int4"
    bad = invoke("plan", "GPT-2", "--quantization", "int3")
    assert bad.exit_code == 1
    assert "unknown quantization 'int3'" in bad.stderr and "int8 or int4" in bad.stderr


def test_the_bundled_gguf_is_planned_in_its_quantized_types(invoke):
    from llmctl.engine.model_loader.default_model import default_model_path

    result = invoke(
        "plan", str(default_model_path()), "--gpus-per-node", "1", "--gpu-memory-gib", "24",
        env={"COLUMNS": "300"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "weights: 0.09 GiB per GPU (Q4_1 GGUF)" in out  # as the engine repacks it
    assert "Q8_0 (embedding), Q4_1 (q, k, v, o, gate, up, down)" in out
    assert "--quantization" not in out


def test_the_run_section_starts_the_cluster_before_serving_on_it(invoke):
    result = invoke("plan", "Llama-3.1-405B", "--nodes", "2", "--max-model-len", "8192")
    assert result.exit_code == 0, result.output
    run = result.stdout[result.stdout.index("Run") :].splitlines()[1:]
    assert run[0].strip() == "llmctl cluster up -i cluster.yaml"
    assert run[1].strip().startswith("llmctl serve -i cluster.yaml Llama-3.1-405B -tp 8 -pp 2")
