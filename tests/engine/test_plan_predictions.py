"""The planner against independent counts: catalog weights against transformers' own models (on
the meta device), and, exactly, the KV block count and each rank's weights against a real engine
on every layout the engine tests run."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from llmctl.cluster.inventory import inventory_from_flags
from llmctl.cluster.plan.catalog import CATALOG
from llmctl.cluster.plan.model_spec import ModelSpec, load_model_spec
from llmctl.cluster.plan.planner import PlanOptions, make_plan
from llmctl.engine import LLM
from llmctl.engine.config import model_catalog
from llmctl.engine.config.engine_config import parse_layer_partition
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor

# the entries typed in as their config.json keys
CATALOG_CONFIGS = {n: e.config for n, e in model_catalog.CATALOG.items() if e.config is not None}


def _hf_config(spec: ModelSpec):
    """The Hugging Face config of a catalog entry, built independently of ModelSpec's counting
    (the entries typed in as config.json keys: transformers' config class on those keys)."""
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        Glm4MoeConfig,
        GPT2Config,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OPTConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if spec.name in CATALOG_CONFIGS:
        values = {
            k: v
            for k, v in CATALOG_CONFIGS[spec.name].items()
            if k not in ("architectures", "model_type", "quantization_config")
        }
        classes = {
            "DeepseekV3ForCausalLM": DeepseekV3Config,
            "Glm4MoeForCausalLM": Glm4MoeConfig,
            "Qwen3MoeForCausalLM": Qwen3MoeConfig,
        }
        return classes[spec.architecture](**values)
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    if spec.architecture == "GPT2LMHeadModel":
        return GPT2Config(
            vocab_size=spec.vocab_size,
            n_embd=spec.hidden_size,
            n_layer=spec.num_layers,
            n_head=spec.num_heads,
            n_positions=spec.max_position_embeddings,
        )
    if spec.architecture == "OPTForCausalLM":
        return OPTConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            ffn_dim=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            max_position_embeddings=spec.max_position_embeddings,
            word_embed_proj_dim=spec.hidden_size,
        )
    shape = spec.shape
    if spec.architecture == "MixtralForCausalLM":
        return MixtralConfig(
            **common,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
        )
    moe = dict(
        num_experts=spec.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
    )
    if spec.architecture == "Qwen2MoeForCausalLM":
        shared = shape.shared_expert_intermediate_size
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=shared)
    if spec.architecture == "Qwen3MoeForCausalLM":
        return Qwen3MoeConfig(**common, **moe, head_dim=spec.head_dim)
    if spec.architecture == "Qwen2ForCausalLM":
        return Qwen2Config(**common)
    if spec.architecture == "Qwen3ForCausalLM":
        return Qwen3Config(**common, head_dim=spec.head_dim)
    if spec.architecture == "Phi3ForCausalLM":
        return Phi3Config(**common)
    if spec.architecture == "Gemma3ForCausalLM":  # windows of 1024, every 6th layer global
        return Gemma3TextConfig(
            **common, head_dim=spec.head_dim, sliding_window=1024, query_pre_attn_scalar=168
        )
    if spec.architecture == "GptOssForCausalLM":  # windows of 128 on every other layer
        return GptOssConfig(
            **common,
            head_dim=spec.head_dim,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            sliding_window=128,
        )
    if spec.architecture == "MistralForCausalLM":
        return MistralConfig(**common, head_dim=spec.head_dim)
    return LlamaConfig(**common, head_dim=spec.head_dim)


@pytest.mark.parametrize("name", list(CATALOG))
def test_catalog_weight_memory_matches_the_parameter_count(name):
    """bfloat16: two bytes a parameter (DeepSeek's and GLM-4.5's routing biases, which
    transformers keeps as float32 buffers, four); an FP8 checkpoint: transformers' parameters
    are the shape's, and the plan's bytes are what the engine holds of them."""
    from transformers import AutoModelForCausalLM

    spec = CATALOG[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(spec))
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    biases = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    plan = make_plan(
        spec,
        inventory_from_flags(1, 1, 10_000),
        PlanOptions(max_model_len=1024, dtype="bfloat16", tensor_parallel_size=1),
    )
    assert spec.total_params() == params + biases
    if not spec.prequantized:
        assert plan.ranks[0].weight_bytes == params * 2 + biases * 4
    else:
        assert params < plan.ranks[0].weight_bytes < 1.1 * params  # about a byte a weight


# Every layout the engine tests run: tp 1/2/3 (9 heads on 3 KV heads: tp=2 deals the KV-head
# groups out 2 + 1), pp 2/3 (4 layers: the default split of pp=3 is 1,2,1) and an uneven
# --pipeline-layer-partition.
LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp3": {"tensor_parallel_size": 3},
    "pp2": {"pipeline_parallel_size": 2},
    "pp3": {"pipeline_parallel_size": 3},
    "pp3-uneven": {"pipeline_parallel_size": 3, "pipeline_layer_partition": "2,1,1"},
}
CASES = (
    [("tiny", layout) for layout in LAYOUTS]
    + [("smollm2", layout) for layout in ("tp1", "tp2", "pp2")]
    # several KV cache groups (sliding layers' blocks freed): shared tensors, per-stage blocks
    + [("gpt-oss", "tp2"), ("gemma3", "pp2")]
)
MODELS = {"tiny": "llama-9-heads", "gpt-oss": "gpt-oss", "gemma3": "gemma3"}


def _engine_kv(caplog, model, **kwargs) -> tuple[int, int, list[int]]:
    """The engine's num_gpu_blocks, the KV cache size it logs (tokens) and each rank's weight
    bytes as loaded."""
    with caplog.at_level(logging.INFO, logger="llmctl"):
        caplog.clear()
        llm = LLM(model, use_tqdm_on_load=False, **kwargs)
        num_blocks = llm.llm_engine.num_blocks
        weights = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
        llm.shutdown()
    match = re.search(r"KV cache size: ([\d,]+) tokens", caplog.text)
    return num_blocks, int(match.group(1).replace(",", "")), weights


@pytest.mark.parametrize(("which", "layout"), CASES, ids=[f"{w}-{lay}" for w, lay in CASES])
def test_plan_predicts_the_engines_kv_block_count_exactly(which, layout, tiny_models, caplog):
    space = 0.05
    model = str(tiny_models.path(MODELS[which])) if which in MODELS else None
    kwargs = LAYOUTS[layout]
    partition = kwargs.get("pipeline_layer_partition")
    plan = make_plan(
        load_model_spec(model),
        inventory_from_flags(1, 2, 1),
        PlanOptions(
            device="cpu",
            kv_cache_space_gib=space,
            max_model_len=256,
            tensor_parallel_size=kwargs.get("tensor_parallel_size"),
            pipeline_parallel_size=kwargs.get("pipeline_parallel_size"),
            pipeline_layer_partition=parse_layer_partition(partition),
        ),
    )
    backend = {"distributed_executor_backend": "mp"} if kwargs else {}
    num_blocks, tokens, weights = _engine_kv(
        caplog, model, kv_cache_space_gib=space, max_model_len=256, **kwargs, **backend
    )
    assert [r.weight_bytes for r in plan.ranks] == weights  # each rank's shard, as loaded
    assert plan.num_kv_blocks == num_blocks
    assert plan.kv_cache_tokens == tokens
    # "KV cache size: N tokens" and "Maximum concurrency ...", as the engine logs them
    assert plan.log_lines()[1] in caplog.text and plan.log_lines()[2] in caplog.text


def test_gguf_file_is_read_like_its_catalog_entry():
    from llmctl.engine.model_loader.default_model import default_model_path

    spec = load_model_spec(str(default_model_path()))
    catalog = CATALOG["SmolLM2-135M-Instruct"]
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads) == (30, 9, 3)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152
    assert spec.total_params() == catalog.total_params()


@pytest.mark.parametrize("name", list(CATALOG))
def test_transformers_configs_give_the_catalog_shape(name):
    """ModelShape.from_hf_config reads transformers' config classes (attribute maps, defaults)
    as the catalog types them in."""
    spec = CATALOG[name]
    assert ModelShape.from_hf_config(_hf_config(spec)) == spec.shape


# -- DeepSeek-V3 in FP8: MLA's latent cache, the FP8 bytes ---------------------------------------

FP8_LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory, smol_tokenizer):
    """A tiny DeepSeek-V3 in block FP8 (tests/fp8_checkpoints.py: partial edge blocks)."""
    from fp8_checkpoints import fp8_configs, write_fp8
    from support import spread_routers
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("plan-fp8")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(fp8_configs()["deepseek-v3"])
    spread_routers(model)
    paths = [root / kind for kind in ("float", "fp8", "dequantized")]
    model.save_pretrained(paths[0])
    smol_tokenizer.save_pretrained(paths[0])
    write_fp8(*paths)
    return str(paths[1])


@pytest.mark.parametrize("layout", list(FP8_LAYOUTS))
def test_plan_predicts_a_deepseek_fp8_engine_exactly(layout, deepseek_fp8, caplog):
    """Each rank's bytes (FP8 linears with their row scales, kv_b_proj and the router in the
    dtype, the routing bias in float32) and the latent cache's blocks, as the engine holds them."""
    kwargs = FP8_LAYOUTS[layout]
    plan = make_plan(
        load_model_spec(deepseek_fp8),
        inventory_from_flags(1, 2, 1),
        PlanOptions(device="cpu", kv_cache_space_gib=0.02, max_model_len=256, **kwargs),
    )
    backend = {"distributed_executor_backend": "mp"} if kwargs else {}
    num_blocks, tokens, weights = _engine_kv(
        caplog, deepseek_fp8, kv_cache_space_gib=0.02, max_model_len=256, **kwargs, **backend
    )
    assert [r.weight_bytes for r in plan.ranks] == weights
    assert plan.num_kv_blocks == num_blocks
    assert plan.kv_cache_tokens == tokens


def _meta_checkpoint(values: dict):
    """DeepSeek-V3's checkpoint names and shapes as it ships (FP8 linears with block scales),
    tensors on the meta device: what the engine's loaders narrow and pack, without the bytes."""
    h, heads, experts = (
        values["hidden_size"],
        values["num_attention_heads"],
        values["n_routed_experts"],
    )
    q_lora, kv_lora, rope = (
        values["q_lora_rank"],
        values["kv_lora_rank"],
        values["qk_rope_head_dim"],
    )
    qk, v = values["qk_nope_head_dim"] + rope, values["v_head_dim"]
    inter, moe = values["intermediate_size"], values["moe_intermediate_size"]

    def tensor(name, shape, dtype=torch.bfloat16):
        def read(index, shape=shape, dtype=dtype):
            return torch.empty(shape, dtype=dtype, device="meta")[index]

        return name, CheckpointTensor(name, shape, read, dtype=dtype)

    def fp8(name, n, k):
        yield tensor(name, (n, k), torch.float8_e4m3fn)
        yield tensor(f"{name}_scale_inv", (-(-n // 128), -(-k // 128)), torch.float32)

    def mlp(prefix, features):
        yield from fp8(f"{prefix}.gate_proj.weight", features, h)
        yield from fp8(f"{prefix}.up_proj.weight", features, h)
        yield from fp8(f"{prefix}.down_proj.weight", h, features)

    vocab = values["vocab_size"]
    yield tensor("model.embed_tokens.weight", (vocab, h))
    yield tensor("lm_head.weight", (vocab, h))
    yield tensor("model.norm.weight", (h,))
    for i in range(values["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield tensor(f"{p}.input_layernorm.weight", (h,))
        yield tensor(f"{p}.post_attention_layernorm.weight", (h,))
        yield from fp8(f"{p}.self_attn.q_a_proj.weight", q_lora, h)
        yield tensor(f"{p}.self_attn.q_a_layernorm.weight", (q_lora,))
        yield from fp8(f"{p}.self_attn.q_b_proj.weight", heads * qk, q_lora)
        yield from fp8(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kv_lora + rope, h)
        yield tensor(f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,))
        yield from fp8(f"{p}.self_attn.kv_b_proj.weight", heads * (qk - rope + v), kv_lora)
        yield from fp8(f"{p}.self_attn.o_proj.weight", h, heads * v)
        if i < values["first_k_dense_replace"]:
            yield from mlp(f"{p}.mlp", inter)
            continue
        yield tensor(f"{p}.mlp.gate.weight", (experts, h))
        yield tensor(f"{p}.mlp.gate.e_score_correction_bias", (experts,), torch.float32)
        for e in range(experts):
            yield from mlp(f"{p}.mlp.experts.{e}", moe)
        yield from mlp(f"{p}.mlp.shared_experts", moe * values["n_shared_experts"])


def _engine_rank_bytes(monkeypatch, tp_rank: int, tp: int, start: int, end: int, ends: bool):
    """The bytes the engine's DeepSeek-V3 holds on `tp_rank` for layers [start, end) (with the
    embedding and LM head when `ends`): its model built and loaded on the meta device from the
    catalog's config (engine/model_loader/loader.py counts them as for a real load)."""
    from transformers import DeepseekV3Config

    from llmctl.engine.config.engine_config import ModelConfig
    from llmctl.engine.distributed import parallel_state
    from llmctl.engine.distributed.partition import PipelineShard
    from llmctl.engine.layers.quantization.quant_config import QuantizationConfig
    from llmctl.engine.model_loader import loader
    from llmctl.engine.model_loader.fp8_checkpoint import pair_fp8_scales

    values = CATALOG_CONFIGS["DeepSeek-V3"]
    config = DeepseekV3Config(
        **{k: v for k, v in values.items() if k not in ("architectures", "model_type")}
    )
    quant = QuantizationConfig.for_checkpoint(values)
    model_config = ModelConfig(
        model="DeepSeek-V3",
        path="",
        hf_config=config,
        architecture="DeepseekV3ForCausalLM",
        dtype="bfloat16",
        max_model_len=1024,
        quantization=quant,
    )
    checkpoint = pair_fp8_scales(_meta_checkpoint(values), quant.weight_block_size)
    monkeypatch.setattr(loader, "_checkpoint", lambda mc: (checkpoint, 0, "meta"))
    group = parallel_state.GroupCoordinator
    parallel_state.set_groups(group(list(range(tp)), tp_rank), group([tp_rank], tp_rank))
    try:
        shard = PipelineShard(start, end, ends, ends)
        model = loader.load_model(model_config, shard, "meta")
    finally:
        parallel_state.reset_groups()
    block = sum(
        math.prod(m.kv_cache_shape(1, 16)) * 2
        for m in model.modules()
        if hasattr(m, "kv_cache_shape")
    )
    return model.loaded_weight_bytes, block


def test_deepseek_v3_on_two_nodes_of_h200s_is_planned_as_the_engine_holds_it(monkeypatch):
    """`llmctl plan DeepSeek-V3 --nodes 2 --gpus-per-node 8 --gpu-memory-gib 141`: FP8 fits
    one node at tp=8, the second node runs a second replica. Each rank's bytes are the engine's
    own model on the catalog's config (one dense and one MoE layer built and loaded on the meta
    device, the rest alike), its latent cache's block bytes the MLA layers' own, and its KV blocks
    the engine's memory profile on those numbers."""
    from llmctl.engine.config.memory_profile import GIB, MemoryProfile

    plan = make_plan(CATALOG["DeepSeek-V3"], inventory_from_flags(2, 8, 141), PlanOptions())
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 1)
    assert plan.data_parallel_size == 2 and plan.nodes_used == 1
    assert any("2 data-parallel replicas, 1 on each of 2 nodes" in r for r in plan.reasons)
    assert "fp8" in plan.weight_line
    values = CATALOG_CONFIGS["DeepSeek-V3"]
    dense, layers = values["first_k_dense_replace"], values["num_hidden_layers"]
    for rank in (0, 7):
        with_ends, block_one = _engine_rank_bytes(monkeypatch, rank, 8, 0, 1, True)
        dense_layer, _ = _engine_rank_bytes(monkeypatch, rank, 8, 0, 1, False)
        moe_layer, _ = _engine_rank_bytes(monkeypatch, rank, 8, dense, dense + 1, False)
        engine = with_ends + (dense - 1) * dense_layer + (layers - dense) * moe_layer
        predicted = plan.ranks[rank]
        assert predicted.weight_bytes == engine
        block = block_one * layers  # (512 + 64) bfloat16 values a token and layer, whole per rank
        assert block == 16 * layers * (512 + 64) * 2 == predicted.kv_block_bytes
        profile = MemoryProfile(
            total_bytes=141 * GIB,
            weight_bytes=engine,
            peak_torch_bytes=engine + predicted.activation_bytes,
            non_torch_bytes=predicted.non_torch_bytes,
        )
        assert profile.kv_cache_bytes(0.9) // block == predicted.num_blocks
    assert plan.num_kv_blocks == min(r.num_blocks for r in plan.ranks)
