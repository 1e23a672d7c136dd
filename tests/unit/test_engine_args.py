"""EngineArgs' option declarations, pure parts: which fields are options of which command, the
argv that gives EngineArgs keywords back to `llmctl serve`, and the planner's defaults."""

from __future__ import annotations

import dataclasses

import pytest

from llmctl.cluster.launch.head_server import Layout, serve_argv
from llmctl.cluster.plan.planner import PlanOptions
from llmctl.engine.config.engine_args import (
    EngineArgs,
    cli_options,
    engine_args_to_argv,
    engine_default,
)
from llmctl.engine.config.memory_profile import DEFAULT_CPU_KV_CACHE_SPACE_GIB
from llmctl.engine.config.options import option


def test_options_per_command():
    names = {command: [o.name for o in cli_options(command)] for command in ("generate", "serve")}
    assert names["serve"] == [o.name for o in cli_options()]  # serve takes every option
    assert set(names["serve"]) - set(names["generate"]) == {
        "served_model_name",
        "skip_tokenizer_init",
        "headless",  # node ranks > 0 of an mp group across nodes serve no API
        "stall_timeout",
        "restart_on_failure",
        "max_restarts",
        # vLLM's multi-node data-parallel flags (engine/dp/placement.py)
        "data_parallel_size_local",
        "data_parallel_start_rank",
        "data_parallel_address",
        "data_parallel_rpc_port",
    }
    assert {o.name for o in cli_options("plan")} == {
        "dtype", "max_model_len", "kv_cache_space_gib", "gpu_memory_utilization", "device",
        "block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
        "pipeline_parallel_size", "pipeline_layer_partition", "quantization",
        "enable_expert_parallel", "data_parallel_size",
    }  # fmt: skip
    # LLM(...) keywords only: no flag.
    assert not {"model", "seed", "max_concurrent_batches"} & set(names["serve"])
    # Once test-only switches, now options a user can give (issue 30).
    assert {"num_gpu_blocks_override", "gguf_dequantize"} <= set(names["generate"])


def test_flags_aliases_and_help_come_from_the_declaration():
    by_name = {o.name: o for o in cli_options()}
    assert by_name["tensor_parallel_size"].param_decls == ("--tensor-parallel-size", "-tp")
    assert by_name["pipeline_parallel_size"].param_decls == ("--pipeline-parallel-size", "-pp")
    assert by_name["enable_expert_parallel"].param_decls == ("--enable-expert-parallel",)
    assert engine_args_to_argv({"enable_expert_parallel": True}) == ["--enable-expert-parallel"]
    assert by_name["enable_prefix_caching"].param_decls == (
        "--enable-prefix-caching/--no-enable-prefix-caching",
    )
    assert by_name["enforce_eager"].param_decls == ("--enforce-eager",)
    assert by_name["kv_cache_space_gib"].help.endswith(
        f"(default: {DEFAULT_CPU_KV_CACHE_SPACE_GIB:g})"
    )
    assert by_name["block_size"].help.endswith("(default: 16)")  # the field's default
    assert by_name["enable_prefix_caching"].help.endswith("(default: enabled)")


def test_engine_args_to_argv_spells_each_value_as_its_flag():
    argv = engine_args_to_argv(
        {
            "tensor_parallel_size": 2,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "dtype": "float32",
            "pipeline_layer_partition": (10, 11, 9),
            "gpu_memory_utilization": 0.75,
            "max_model_len": None,  # not given: the engine's default
        }
    )
    assert argv == [
        "--dtype", "float32", "--gpu-memory-utilization", "0.75", "--enforce-eager",
        "--no-enable-prefix-caching", "--tensor-parallel-size", "2",
        "--pipeline-layer-partition", "10,11,9",
    ]  # fmt: skip
    assert engine_args_to_argv({"enforce_eager": False}) == []  # the default; no --no- form
    with pytest.raises(ValueError, match="no command-line flag for seed"):
        engine_args_to_argv({"seed": 1})


def test_head_server_argv_is_the_layout_then_the_engine_options():
    argv = serve_argv(
        "/models/smol",
        Layout(2, 3, ""),
        8011,
        {"served_model_name": "smol", "gpu_memory_utilization": 0.8, "enforce_eager": True},
    )
    assert argv == [
        "llmctl", "serve", "/models/smol", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "3", "--distributed-executor-backend", "ray", "--host",
        "0.0.0.0", "--port", "8011", "--served-model-name", "smol", "--gpu-memory-utilization",
        "0.8", "--enforce-eager",
    ]  # fmt: skip


def test_plan_options_default_to_the_engine_defaults():
    plan_fields = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    # The planner's own meaning: a device to plan for (no auto), and None = choose the layout.
    own = {"device", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}
    for o in cli_options("plan"):
        assert o.name in plan_fields, f"plan --{o.name} has no PlanOptions field"
        if o.name not in own:
            assert plan_fields[o.name] == engine_default(o.name), o.name


def test_a_flag_without_its_negation_must_default_to_false():
    Broken = dataclasses.make_dataclass(
        "Broken",
        [("fast", bool, option("Go fast.", default=True, negatable=False))],
        bases=(EngineArgs,),
    )
    with pytest.raises(TypeError, match="--no-fast"):
        cli_options(args_class=Broken)


def test_aliases_spell_the_layout_as_vllm_does():
    argv = engine_args_to_argv(
        {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "dtype": "bfloat16"},
        aliases=True,
    )
    assert argv == ["--dtype", "bfloat16", "-tp", "8", "-pp", "2"]


def test_the_plans_serve_command_carries_what_its_prediction_assumed():
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.catalog import CATALOG
    from llmctl.cluster.plan.planner import make_plan

    cpu = make_plan(
        CATALOG["SmolLM2-135M-Instruct"],
        inventory_from_flags(1, 2, 80),
        PlanOptions(device="cpu", kv_cache_space_gib=2.0, block_size=32),
    )
    assert cpu.commands["serve"] == (
        "llmctl serve SmolLM2-135M-Instruct --kv-cache-space-gib 2.0 --device cpu --block-size 32"
    )
    cuda = make_plan(
        CATALOG["Llama-3.1-8B"],
        inventory_from_flags(1, 8, 80),
        PlanOptions(tensor_parallel_size=2, max_model_len=4096, gpu_memory_utilization=0.8),
    )
    assert cuda.commands["serve"] == (
        "llmctl serve Llama-3.1-8B -tp 2 --distributed-executor-backend mp "
        "--max-model-len 4096 --gpu-memory-utilization 0.8"
    )
