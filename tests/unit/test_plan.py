"""make_plan follows the seeds' rules, then does better (pure: no torch, no processes)."""

from __future__ import annotations

import pytest

from llmctl.cluster.errors import PlanError
from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG, find_in_catalog
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine.errors import ConfigError

SHORT = PlanOptions(max_model_len=4096)


def test_fits_one_gpu():
    plan = make_plan(CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 8, 80), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 1)
    assert plan.data_parallel_size == 8  # a replica per GPU, each in its own worker process
    assert plan.distributed_executor_backend == "mp"
    assert plan.alternatives and plan.alternatives[0][0] == "tp=8, pp=1"  # throughput option
    one = make_plan(CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 8, 80),
                    PlanOptions(max_model_len=4096, data_parallel_size=1))  # fmt: skip
    assert (one.data_parallel_size, one.distributed_executor_backend) == (1, "uni")


def test_model_needing_4_gpus_on_a_4_gpu_node_gets_tp4():
    # Llama-2-70B in float16 is 138 GB: two 48 GB GPUs cannot hold it, four can.
    plan = make_plan(CATALOG["Llama-2-70B"], inventory_from_flags(1, 4, 48), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (4, 1)
    assert plan.distributed_executor_backend == "mp"
    assert any(layout.startswith("tp=2") for layout, _ in plan.rejected)


def test_16_gpus_in_2_nodes_for_a_model_too_big_for_one_node():
    plan = make_plan(CATALOG["Llama-3.1-405B"], inventory_from_flags(2, 8, 80), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 2)
    assert plan.nodes_used == 2 and plan.gpus_used == 16
    assert plan.distributed_executor_backend == "ray"
    assert plan.commands["cluster_up"] == "llmctl cluster up -i cluster.yaml"
    assert "-tp 8 -pp 2 --distributed-executor-backend ray" in plan.commands["serve"]


def test_gpu_count_that_does_not_divide_the_heads_gives_pipeline_parallel():
    # Llama-2-13B (40 heads, 26 GB in float16) on 3 GPUs of 16 GB: tp=2 is too small and tp=3
    # does not divide 40 heads, so tp=1, pp=3.
    plan = make_plan(CATALOG["Llama-2-13B"], inventory_from_flags(1, 3, 16), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 3)
    assert any("does not divide 40 heads" in r for r in plan.reasons)
    uneven = make_plan(
        CATALOG["Llama-2-13B"],
        inventory_from_flags(1, 3, 16),
        PlanOptions(max_model_len=4096, allow_uneven_tp=True),
    )
    assert (uneven.tensor_parallel_size, uneven.pipeline_parallel_size) == (3, 1)


def test_pcie_nodes_prefer_pipeline_parallel():
    plan = make_plan(CATALOG["Llama-2-70B"], inventory_from_flags(1, 4, 48, "pcie"), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 4)
    assert any("PCIe" in r for r in plan.reasons)


def test_uneven_layer_split_balances_the_stages():
    # Llama-3.1-70B's 128k-token vocabulary: the embedding and LM head outweigh a layer.
    inventory = inventory_from_flags(1, 8, 40, "pcie")
    plan = make_plan(CATALOG["Llama-3.1-70B"], inventory, PlanOptions(max_model_len=8192))
    parts = plan.layer_partition
    assert plan.pipeline_parallel_size == len(parts) and sum(parts) == 80
    assert not plan.default_partition
    assert parts[0] < max(parts) and parts[-1] < max(parts)  # the embedding and LM head stages
    assert "--pipeline-layer-partition " + ",".join(map(str, parts)) in plan.commands["serve"]
    even = make_plan(
        CATALOG["Llama-3.1-70B"],
        inventory,
        PlanOptions(
            max_model_len=8192, pipeline_parallel_size=5, pipeline_layer_partition=(16,) * 5
        ),
    )
    assert even.layer_partition == (16,) * 5 and plan.num_kv_blocks > even.num_kv_blocks


def test_min_concurrency_needs_more_gpus():
    one = make_plan(CATALOG["Llama-3.1-70B"], inventory_from_flags(1, 8, 80), SHORT)
    many = make_plan(
        CATALOG["Llama-3.1-70B"],
        inventory_from_flags(1, 8, 80),
        PlanOptions(max_model_len=4096, min_concurrency=64),
    )
    assert many.tensor_parallel_size > one.tensor_parallel_size
    assert many.kv_cache_tokens >= 64 * 4096


def test_too_big_says_what_is_missing_and_what_would_fit():
    # Llama-3.1-70B (131 GiB in bfloat16) on 2 x 24 GiB: not even its 4-bit weights fit.
    with pytest.raises(PlanError) as err:
        make_plan(CATALOG["Llama-3.1-70B"], inventory_from_flags(1, 2, 24), SHORT)
    assert "weights 131.4 GiB (bfloat16)" in err.value.message
    assert "GiB more memory is needed" in err.value.message
    assert "GPUs of 24 GiB" in err.value.hint
    assert "even --quantization int4 does not fit" in err.value.hint
    # On 4 x 24 GiB its 8-bit weights fit: that plan is proposed instead (test_plan_quantization).
    plan = make_plan(CATALOG["Llama-3.1-70B"], inventory_from_flags(1, 4, 24), SHORT)
    assert plan.quantization == "int8"


def test_shorter_context_suggested_when_only_length_is_the_problem():
    with pytest.raises(PlanError) as err:
        make_plan(CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 1, 24), PlanOptions())
    assert "--max-model-len" in err.value.hint


def test_log_lines_and_json():
    plan = make_plan(CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 8, 80), SHORT)
    assert plan.log_lines()[0] == f"# KV cache blocks: {plan.num_kv_blocks} (block size 16)"
    assert plan.log_lines()[1] == f"GPU KV cache size: {plan.num_kv_blocks * 16:,} tokens"
    data = plan.to_json()
    for key in (
        "tensor_parallel_size", "pipeline_parallel_size", "nodes_used", "gpus_used",
        "layer_partition", "per_gpu_weight_gib", "per_gpu_kv_cache_gib", "kv_cache_tokens",
        "num_kv_blocks", "block_size", "max_model_len", "max_concurrency",
        "distributed_executor_backend", "reasons", "commands",
    ):  # fmt: skip
        assert key in data, key
    assert data["max_concurrency"] == round(plan.kv_cache_tokens / 4096, 2)


def test_forced_layout_is_evaluated_and_checked():
    spec = CATALOG["SmolLM2-135M-Instruct"]
    plan = make_plan(spec, inventory_from_flags(1, 8, 80), PlanOptions(tensor_parallel_size=2))
    assert plan.tensor_parallel_size == 2
    assert plan.ranks[0].weight_bytes > plan.ranks[1].weight_bytes  # 6+3 heads: uneven
    with pytest.raises(ConfigError) as err:
        make_plan(spec, inventory_from_flags(1, 8, 80), PlanOptions(tensor_parallel_size=16))
    assert "1, 2, 3, 4, 5, 6, 7, 8, 9" in err.value.hint


def test_catalog_lookup_by_hub_id():
    assert find_in_catalog("facebook/opt-13b") is CATALOG["OPT-13B"]
    assert find_in_catalog("gpt2") is CATALOG["GPT-2"]
    assert find_in_catalog("llama-3.1-8b") is CATALOG["Llama-3.1-8B"]
    assert find_in_catalog("nope") is None


def test_tied_lm_head_counts_once_unless_stages_split_it():
    spec: ModelSpec = CATALOG["SmolLM2-135M-Instruct"]
    tied = spec.embedding_params() + spec.head_params(with_embedding=True)
    split = spec.embedding_params() + spec.head_params(with_embedding=False)
    assert split - tied == spec.vocab_size * spec.hidden_size


def test_uneven_tp_is_offered_as_llmctl_only():
    # Llama-3.1-8B (32 heads, 8 KV heads) on a node of 3 GPUs: vLLM has no tp=3 for it, our
    # engine deals the 8 KV-head groups out 3, 3 and 2.
    plan = make_plan(CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 3, 80), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 1)
    [(layout, offer)] = plan.alternatives
    assert layout == "tp=3, pp=1 (llmctl only)"
    assert "KV heads 3,3,2 (query heads 12,12,8) per rank" in offer
    assert "vLLM cannot run it, since tp=3 does not divide 32 heads (8 KV)" in offer
    assert "the node's full width" in offer


def test_uneven_tp_that_fits_is_offered_instead_of_rejected():
    plan = make_plan(CATALOG["Llama-2-13B"], inventory_from_flags(1, 3, 16), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 3)  # vLLM's choice
    layouts = dict(plan.alternatives)
    offer = layouts["tp=3, pp=1 (llmctl only)"]
    assert "KV heads 14,13,13" in offer and "--allow-uneven-tp lets the planner choose it" in offer
    assert "tp=3, pp=1" not in dict(plan.rejected)
    # What it offers is what the planner computes when it is allowed to choose it.
    chosen = make_plan(
        CATALOG["Llama-2-13B"],
        inventory_from_flags(1, 3, 16),
        PlanOptions(max_model_len=4096, allow_uneven_tp=True),
    )
    assert f"holds {chosen.kv_cache_tokens:,} KV tokens" in offer
    assert any(r.startswith("llmctl only: uneven tensor parallel") for r in chosen.reasons)


def test_a_forced_uneven_tp_says_it_is_llmctl_only():
    plan = make_plan(
        CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 3, 80), PlanOptions(tensor_parallel_size=3)
    )
    assert "llmctl only: uneven tensor parallel: KV heads 3,3,2" in plan.reasons[1]
    even = make_plan(
        CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 8, 80), PlanOptions(tensor_parallel_size=4)
    )
    assert not any("llmctl only" in r for r in even.reasons)


def test_across_nodes_the_uneven_full_width_is_offered_too():
    # Llama-3.1-70B (64 heads, 8 KV heads) on 2 nodes of 3 x 40 GB: vLLM's choice is tp=2 x pp=2.
    plan = make_plan(CATALOG["Llama-3.1-70B"], inventory_from_flags(2, 3, 40), SHORT)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (2, 2)
    offer = dict(plan.alternatives)["tp=3, pp=2 (llmctl only)"]
    assert offer.startswith("every GPU of the 2 nodes:")
    assert "KV heads 3,3,2 (query heads 24,24,16) per rank" in offer
    # One node's tp=3 is too small, and says so as the uneven layout it is.
    why = dict(plan.rejected)["tp=3, pp=1 (llmctl only)"]
    assert why.startswith("uneven tensor parallel holds") and why.endswith("needs 4,096")


def test_a_float_model_too_big_for_the_inventory_is_planned_quantized():
    # Llama-2-13B in float16 is 24.2 GiB: one 24 GiB GPU cannot hold it; its int8 weights fit.
    spec = CATALOG["Llama-2-13B"]
    plan = make_plan(spec, inventory_from_flags(1, 1, 24), PlanOptions())
    assert (plan.tensor_parallel_size, plan.quantization) == (1, "int8")
    assert plan.commands["serve"] == "llmctl serve Llama-2-13B --quantization int8"
    assert plan.reasons[0].startswith("too big in float16: Llama-2-13B does not fit")
    assert plan.reasons[1].startswith("so weight-only int8 quantization (--quantization int8)")
    assert "1.125 bytes per weight" in plan.reasons[1]
    # 8-bit groups of 32 with a float32 scale for the linears; the rest in float16.
    linears = spec.num_layers * (4 * 5120 * 5120 + 3 * 5120 * 13824)
    rest = spec.total_params() - linears
    assert plan.ranks[0].weight_bytes == linears * 36 // 32 + 2 * rest
    assert (
        plan.weight_line == f"weights: {plan.ranks[0].weight_bytes / 2**30:.2f} GiB per GPU (int8)"
    )
    [(layout, offer)] = plan.alternatives
    assert layout == "tp=1, pp=1 with --quantization int4"
    assert "0.75 bytes per weight" in offer
    # On 16 GiB only its 4-bit weights fit.
    small = make_plan(spec, inventory_from_flags(1, 1, 16), PlanOptions())
    assert small.quantization == "int4" and small.weight_format == "int4"
    assert small.commands["serve"].endswith("--quantization int4")
    # A float plan that fits stays float.
    fits = make_plan(CATALOG["Llama-3.1-8B"], inventory_from_flags(1, 1, 24), SHORT)
    assert fits.quantization is None and fits.weight_format == "bfloat16"
    assert "--quantization" not in fits.commands["serve"]


def test_asked_quantization_that_does_not_fit_proposes_the_smaller_one():
    with pytest.raises(PlanError) as err:
        make_plan(
            CATALOG["Llama-2-13B"], inventory_from_flags(1, 1, 16), PlanOptions(quantization="int8")
        )
    assert "weights 13.9 GiB (int8)" in err.value.message
    assert err.value.hint.endswith("--quantization int4 fits (tp=1, pp=1)")
    with pytest.raises(ConfigError) as bad:
        PlanOptions(quantization="fp4")
    assert "int8 or int4" in bad.value.hint


def _gguf_spec(type_name: str, down: str = "Q4_1") -> ModelSpec:
    """SmolLM2 as a GGUF of `type_name` linears and `down` down_proj (what load_model_spec reads
    from a file)."""
    from llmctl.cluster.plan.weight_format import dense_format, gguf_weight_formats

    shape = CATALOG["SmolLM2-135M-Instruct"].shape
    names = [f"blk.{i}.{t}.weight" for i in range(shape.num_layers)
             for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                       "ffn_down", "attn_norm", "ffn_norm")]  # fmt: skip
    types = [(n, "F32" if "norm" in n else down if "down" in n else type_name) for n in names]
    types += [
        ("token_embd.weight", "Q8_0"),
        ("output_norm.weight", "F32"),
    ]
    formats = gguf_weight_formats(dense_format("float32", 4), types)
    return ModelSpec(name="smol.gguf", shape=shape, dtype="float32", weight_formats=formats)


def test_a_gguf_is_planned_in_its_own_types_and_refuses_quantization():
    spec = _gguf_spec("Q4_1")
    plan = make_plan(spec, inventory_from_flags(1, 1, 24), PlanOptions(dtype="float32"))
    assert plan.weight_format == "Q4_1 GGUF" and plan.quantization is None
    assert plan.weight_line == "weights: 0.09 GiB per GPU (Q4_1 GGUF)"  # as repacked in memory
    assert "--quantization" not in plan.commands["serve"]
    with pytest.raises(ConfigError) as err:
        make_plan(spec, inventory_from_flags(1, 1, 24), PlanOptions(quantization="int4"))
    assert err.value.message == (
        "smol.gguf is already quantized (Q4_1 GGUF); --quantization int4 quantizes float "
        "checkpoints"
    )
    assert err.value.hint.startswith("drop --quantization")


def test_a_tensor_parallel_split_that_cuts_gguf_blocks_is_refused():
    # A Q4_K down_proj: every row-parallel split must fall on whole blocks of 256 (as the engine
    # requires of the file's largest block), and SmolLM2's o_proj has 576 inputs: tp=2 gives 384.
    spec = _gguf_spec("Q4_1", down="Q4_K")
    inventory = inventory_from_flags(1, 8, 24)
    with pytest.raises(ConfigError) as err:
        make_plan(spec, inventory, PlanOptions(tensor_parallel_size=2))
    assert "o (384 of 576 inputs; groups of 256)" in err.value.message
    assert err.value.hint == "use tensor_parallel_size 1, or pipeline parallel"
    # Q4_1's blocks of 32: tp=4 splits o_proj and down_proj on whole blocks, tp=5 does not.
    q4_1 = _gguf_spec("Q4_1")
    assert make_plan(q4_1, inventory, PlanOptions(tensor_parallel_size=4)).ranks
    with pytest.raises(ConfigError) as err:
        make_plan(q4_1, inventory, PlanOptions(tensor_parallel_size=5))
    assert "down (308 of 1536 inputs; groups of 32)" in err.value.message
    assert err.value.hint == "use tensor_parallel_size 1, 2, 3, 4, 6, 8, or pipeline parallel"


def test_quantized_layouts_keep_whole_groups_on_every_rank():
    # Llama-3.1-8B's 14336 MLP features over tp=3: 4779, 4779 and 4778 down_proj inputs per
    # rank, not whole groups of 32, so the uneven tp=3 offered in float is not offered in int4.
    inventory = inventory_from_flags(1, 3, 80)
    assert "tp=3, pp=1 (llmctl only)" in dict(
        make_plan(CATALOG["Llama-3.1-8B"], inventory, SHORT).alternatives
    )
    int4 = make_plan(
        CATALOG["Llama-3.1-8B"], inventory, PlanOptions(max_model_len=4096, quantization="int4")
    )
    assert int4.alternatives == ()
    with pytest.raises(ConfigError) as err:
        make_plan(
            CATALOG["Llama-3.1-8B"],
            inventory,
            PlanOptions(max_model_len=4096, quantization="int4", tensor_parallel_size=3),
        )
    assert "down (4779 of 14336 inputs; groups of 32)" in err.value.message
