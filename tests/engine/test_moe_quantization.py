"""`--quantization int8|int4` on a float mixture-of-experts checkpoint: every expert's matrices
(and Qwen2-MoE's shared expert and dense layers) are quantized round-to-nearest as each rank
reads its slice and run packed; the routers stay float.

The oracle is llmctl's float path on a checkpoint whose quantized weights were replaced by their
round trip (the float weights the quantized engine computes with): the same greedy tokens, or,
where accumulation order parts them, a first differing position whose logit gap is below 1e-3
(test_quantized.assert_same_greedy). Tensor and expert parallel equal one rank, and the planner
predicts each rank's packed bytes exactly."""

from __future__ import annotations

import pytest
import torch
from support import mixtral_with_experts_of, random_prompts, tiny_configs
from test_quantized import GREEDY_32, TINY, assert_same_greedy, generate

from llmctl.engine import LLM
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.quantization.linear_method import dequantize_groups, quantize_rtn

PROMPTS = random_prompts([3, 9, 17, 30], seed=5)


def config_of(family: str):
    """A tiny MoE config; "mixtral-64": Mixtral with experts of 64 features, so that tensor
    parallelism gives each rank whole groups of 32 of the down matrices; "qwen2-moe-64":
    Qwen2-MoE with a shared expert of 64 features (the tests' own has 48, not whole groups)."""
    if family == "mixtral-64":
        return mixtral_with_experts_of(64)
    if family == "qwen2-moe-64":
        config = tiny_configs()["qwen2-moe"]
        config.shared_expert_intermediate_size = 64
        return config
    return tiny_configs()[family]


def is_quantized(name: str) -> bool:
    """Whether the engine quantizes this checkpoint tensor under --quantization: the decoder
    layers' linears, experts included (stacked `experts.gate_up_proj`, `experts.down_proj`);
    not the routers (`mlp.gate`, `shared_expert_gate`), norms, embedding or LM head."""
    return ".layers." in name and (name.endswith("proj.weight") or name.endswith("_proj"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smol_tokenizer):
    """(family, bits) -> a saved tiny model: bits None, the float model; 4 or 8, the same model
    with each quantized tensor replaced by its round trip."""
    from transformers import AutoModelForCausalLM

    root, made = tmp_path_factory.mktemp("moe-rtn"), {}

    def get(family: str, bits: int | None = None):
        if (family, bits) not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config_of(family)).eval()
            if bits is not None:
                state = model.state_dict()
                for name, w in state.items():
                    if is_quantized(name):
                        rows = w.reshape(-1, w.shape[-1])  # stacked experts: rows of [E x N, K]
                        q, scales, zeros = quantize_rtn(rows, bits, 32)
                        w.copy_(dequantize_groups(q, scales, zeros, 32).reshape(w.shape))
            path = root / f"{family}-{bits}"
            model.save_pretrained(path)
            smol_tokenizer.save_pretrained(path)
            made[family, bits] = path
        return made[family, bits]

    return get


@pytest.mark.parametrize(
    "family, method",
    [("mixtral", "int4"), ("mixtral", "int8"), ("qwen2-moe-64", "int4"), ("qwen3-moe", "int4")],
)
def test_quantized_experts_match_float_on_the_rtn_weights(checkpoints, family, method):
    llm = LLM(str(checkpoints(family)), quantization=method, **TINY)
    model = llm.llm_engine.executor.worker.model_runner.model
    moe = next(m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock"))
    assert moe.experts.quant_method is not None  # the experts run packed
    assert moe.gate.quant_method is None  # the router stays float
    if family == "qwen2-moe-64":
        assert moe.shared_expert.gate_up_proj.quant_method is not None
        assert moe.shared_expert_gate.quant_method is None
    native = generate(llm, PROMPTS)
    reference = LLM(str(checkpoints(family, int(method[3:]))), **TINY)
    assert_same_greedy(native, generate(reference, PROMPTS))


@pytest.mark.parametrize(
    "split",
    [{}, dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)],
    ids=["tp1", "tp2", "ep2"],
)
def test_quantized_experts_split_over_two_ranks_as_one(checkpoints, split):
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    path = str(checkpoints("mixtral-64"))
    backend = {"distributed_executor_backend": "mp"} if split else {}
    with LLM(path, quantization="int4", **split, **backend, **TINY) as llm:
        loaded = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
        native = llm.generate(PROMPTS, GREEDY_32, use_tqdm=False)
    options = PlanOptions(
        device="cpu",
        dtype="float32",
        quantization="int4",
        kv_cache_space_gib=TINY["kv_cache_space_gib"],
        max_model_len=TINY["max_model_len"],
        tensor_parallel_size=split.get("tensor_parallel_size"),
        enable_expert_parallel=split.get("enable_expert_parallel", False),
    )
    plan = make_plan(load_model_spec(path), inventory_from_flags(1, 2, 1), options)
    assert [r.weight_bytes for r in plan.ranks] == loaded  # the plan's bytes are the engine's
    reference = LLM(str(checkpoints("mixtral-64", 4)), **TINY)
    assert_same_greedy(native, generate(reference, PROMPTS))


def test_groups_the_layers_or_the_split_would_cut_are_refused(checkpoints):
    # Refused before any process starts, naming the fix. The tiny Qwen2-MoE's shared expert has
    # 48 features: its down matrix is not whole groups of 32 even on one rank.
    with pytest.raises(ConfigError) as err:
        LLM(str(checkpoints("qwen2-moe")), quantization="int4", **TINY)
    assert err.value.message == (
        "--quantization int4 quantizes groups of 32 input features, but Qwen2MoeForCausalLM "
        "has layers of 48 input features"
    )
    assert "leave out --quantization" in err.value.hint
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    spec = load_model_spec(str(checkpoints("qwen2-moe")))
    with pytest.raises(ConfigError) as plan_err:  # the planner says the same
        make_plan(spec, inventory_from_flags(1, 1, 1), PlanOptions(quantization="int4"))
    assert plan_err.value.message == err.value.message
    # The tiny Mixtral's experts of 32 features: tp=2 would give each rank 16 inputs of their
    # down matrices; whole experts per rank (expert parallel) keep them whole.
    with pytest.raises(ConfigError) as err:
        LLM(
            str(checkpoints("mixtral")),
            quantization="int8",
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            **TINY,
        )
    assert "tensor_parallel_size=2 would cut the --quantization int8 groups of 32" in (
        err.value.message
    )
    assert err.value.hint == (
        "use tensor_parallel_size 1, or --pipeline-parallel-size, or --enable-expert-parallel "
        "(whole experts per rank)"
    )
