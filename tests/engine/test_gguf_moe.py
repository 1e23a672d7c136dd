"""Mixture-of-experts GGUF files (Mixtral as llama.cpp writes it: architecture `llama` with
experts; `qwen2moe` with its shared expert; `qwen3moe` with q/k norm): a tiny random model written
with gguf.GGUFWriter as llama.cpp lays it out (stacked ffn_*_exps expert tensors, Llama's q/k rows
permuted, the shared expert gate as a vector; experts in F16, the rest F32) generates token for
token what the same weights give from safetensors, in llmctl and in transformers; alone, and split
over two ranks by experts.

Quantized experts (Q8_0, Q4_0, Q4_1, and Q4_K_M's Q4_K / Q6_K mix) run in their GGUF blocks:
their tokens are those of llmctl's float path on the dequantized weights (`gguf_dequantize`),
or, where accumulation order parts them, the reference's logit gap between the two choices at
the first differing position is below 1e-3 (printed); alone, tensor parallel and expert
parallel; and the planner predicts each rank's packed weight bytes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import (
    assert_same_greedy,
    mixtral_with_experts_of,
    random_prompts,
    tiny_configs,
    token_ids,
)

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError, UnsupportedQuantizationError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
GGUF_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}
# Hugging Face module name -> GGUF tensor name, per layer
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
EXPERT_ROLES = {  # expert matrix name -> stacked GGUF tensor
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def config_of(family: str):
    """The tiny config of a family; "mixtral-64": Mixtral with experts of 64 features (two
    Q8_0 blocks, so tensor parallelism gives each rank whole blocks of the down matrices);
    "mixtral-256": Mixtral of hidden size 256 and 4 experts of 256 features (whole K-quant
    blocks of 256)."""
    if family == "mixtral-64":
        return mixtral_with_experts_of(64)
    if family == "mixtral-256":
        config = tiny_configs()["mixtral"]
        config.hidden_size = config.intermediate_size = 256
        config.num_local_experts, config.num_hidden_layers = 4, 1
        return config
    config = tiny_configs()[family]
    if family == "qwen2-moe":
        config.mlp_only_layers = []  # llama.cpp runs every layer as MoE
    return config


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute of Llama's q/k rows (the loader undoes it)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def gguf_tensors(family: str, config, directory) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (one per expert matrix) under llama.cpp's names and layouts."""
    from safetensors.numpy import load_file

    state = load_file(str(directory / "model.safetensors"))
    out, experts = {}, {}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, w in state.items():
        base, kind = name.rsplit(".", 1)
        if base in top:
            out[f"{top[base]}.{kind}"] = w
            continue
        _, _, layer, rest = base.split(".", 3)
        if ".experts." in rest:  # mlp.experts.3.w1 -> stacked by expert
            _, expert, role = rest.rsplit(".", 2)
            stacked = f"blk.{layer}.{EXPERT_ROLES[role]}.{kind}"
            experts.setdefault(stacked, {})[int(expert)] = w
            continue
        gguf_name = f"blk.{layer}.{LAYER_NAMES[rest]}.{kind}"
        if family == "mixtral" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in rest else config.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        if rest == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # [1, H] -> [H], as llama.cpp stores it
        out[gguf_name] = w
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)]).astype(np.float16)
    return out


def random_blocks(rng, type_name: str, shape) -> np.ndarray:
    """Random blocks of a K-quant type (gguf.quants cannot quantize to them) for a stacked
    [E, rows, K] tensor: random bytes, with the f16 super-block scales small and finite."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    *lead, k = shape
    raw = rng.integers(0, 256, (*lead, k // block, size), dtype=np.uint8)
    scale = lambda n: rng.uniform(0.001, 0.01, (*lead, k // block, n))  # noqa: E731
    if type_name == "Q4_K":  # d, dmin (f16), scales[12], qs[128]
        raw[..., 0:4] = scale(2).astype(np.float16).view(np.uint8)
    elif type_name == "Q6_K":  # ql[128], qh[64], scales int8[16], d (f16)
        raw[..., 208:210] = scale(1).astype(np.float16).view(np.uint8)
    return raw.reshape(*lead, -1)


def write_gguf(path, family: str, config, directory, experts: str | dict = "F16") -> None:
    """`experts`: the stacked expert tensors' type (F16, or a quantized type such as Q8_0), or
    a type per kind of tensor ({"ffn_gate_exps": "Q4_K", "attn_q": "Q8_0", ...}: the others
    as written by default; K-quants get random blocks)."""
    import gguf

    family = family.split("-")[0] if family.startswith("mixtral") else family
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[family])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family != "mixtral":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2-moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for name, w in gguf_tensors(family, config, directory).items():
        if isinstance(experts, dict):  # by the tensor's kind: ffn_up_exps, attn_q, output, ...
            kind = experts.get(name.split(".")[-2], "F16")
        else:
            kind = experts if "_exps." in name else "F16"
        if kind != "F16":
            qtype = gguf.GGMLQuantizationType[kind]
            if kind in ("Q4_K", "Q6_K"):
                raw = random_blocks(rng, kind, w.shape)
            else:
                raw = gguf.quants.quantize(w.astype(np.float32), qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            continue
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (safetensors directory, GGUF file, the Hugging Face model): the same weights,
    the experts rounded to float16 in both (the GGUF stores them as F16)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf-moe")
    cache = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(0)
            config = config_of(family)
            model = AutoModelForCausalLM.from_config(config).eval()
            model.config.architectures = [type(model).__name__]
            state = model.state_dict()
            for name, tensor in state.items():
                if ".experts." in name:
                    tensor.copy_(tensor.half().float())
            directory = root / family
            model.save_pretrained(directory)
            gguf_file = root / f"{family}.gguf"
            write_gguf(gguf_file, family, config, directory)
            cache[family] = directory, gguf_file, model
        return cache[family]

    return get


def generate(path, prompts, **kwargs) -> list[list[int]]:
    with LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        skip_tokenizer_init=True,
        **kwargs,
    ) as llm:
        return token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_a_moe_gguf_generates_what_its_safetensors_do(family, models, hf_greedy):
    directory, gguf_file, hf_model = models(family)
    prompts = random_prompts([5, 11, 20], seed=3)
    from_gguf = generate(gguf_file, prompts)
    assert from_gguf == generate(directory, prompts)
    assert from_gguf == [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]


def test_a_moe_gguf_splits_over_expert_parallel_ranks(models):
    directory, gguf_file, _ = models("qwen2-moe")
    prompts = random_prompts([7, 13], seed=4)
    split = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    assert generate(gguf_file, prompts, **split) == generate(directory, prompts)


def generate_outputs(path, prompts, **kwargs) -> list:
    """RequestOutputs with the top-5 logprobs of each greedy token, and the model's
    quantization as the engine resolved it."""
    with LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        skip_tokenizer_init=True,
        **kwargs,
    ) as llm:
        quantization = llm.llm_engine.config.model_config.quantization
        return llm.generate(prompts, GREEDY_LOGPROBS, use_tqdm=False), quantization


@pytest.fixture(scope="module")
def quantized_gguf(models, tmp_path_factory):
    """(family, experts) -> a GGUF file of that family's tiny model, its stacked expert tensors
    of the type(s) `experts` (the rest as write_gguf writes them: float)."""
    root = tmp_path_factory.mktemp("gguf-moe-quantized")
    cache = {}

    def get(family: str, experts: str | tuple[tuple[str, str], ...]):
        key = (family, experts)
        if key not in cache:
            directory = models(family)[0]
            name = experts if isinstance(experts, str) else "-".join(t for _, t in experts)
            path = root / f"{family}-{name}.gguf"
            types = experts if isinstance(experts, str) else dict(experts)
            write_gguf(path, family, config_of(family), directory, experts=types)
            cache[key] = path
        return cache[key]

    return get


Q4_K_M_EXPERTS = (("ffn_gate_exps", "Q4_K"), ("ffn_up_exps", "Q6_K"), ("ffn_down_exps", "Q6_K"))
# As llama.cpp quantizes a whole file: every matrix but the router (ffn_gate_inp stays float).
ALL_Q8_0 = tuple(
    (kind, "Q8_0")
    for kind in ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output")
    + ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
)


@pytest.mark.parametrize(
    "family, experts",
    [
        ("mixtral", "Q8_0"),
        ("mixtral", "Q4_0"),
        ("qwen2-moe", "Q4_1"),
        ("qwen3-moe", "Q8_0"),
        # Q4_K_M's mix: an expert's gate (Q4_K) and up (Q6_K) are two packed formats
        ("mixtral-256", Q4_K_M_EXPERTS),
        ("mixtral", ALL_Q8_0),  # attention, embedding and LM head quantized too
    ],
)
def test_quantized_experts_run_natively_as_the_float_path(family, experts, quantized_gguf):
    path = quantized_gguf(family, experts)
    prompts = random_prompts([5, 11, 20], seed=5)
    native, quantization = generate_outputs(path, prompts)
    types = (experts,) if isinstance(experts, str) else tuple(sorted({t for _, t in experts}))
    assert quantization.method == "gguf" and quantization.gguf_types == types
    reference, float_quantization = generate_outputs(path, prompts, gguf_dequantize=True)
    assert float_quantization is None
    assert_same_greedy(native, reference)


@pytest.mark.parametrize(
    "split",
    [
        dict(tensor_parallel_size=2),  # each rank: 32 of every expert's 64 features
        dict(tensor_parallel_size=2, enable_expert_parallel=True),  # 4 whole experts each
    ],
    ids=["tp2", "ep2"],
)
def test_quantized_experts_split_over_two_ranks_as_the_float_path(split, quantized_gguf):
    path = quantized_gguf("mixtral-64", "Q8_0")
    prompts = random_prompts([7, 13], seed=6)
    native, _ = generate_outputs(path, prompts, **split)
    reference, _ = generate_outputs(path, prompts, gguf_dequantize=True)
    assert_same_greedy(native, reference)


def test_a_tensor_parallel_split_inside_an_experts_block_is_refused(quantized_gguf):
    # The tiny Mixtral's experts have 32 features: tp=2 would give each rank half a Q8_0 block
    # of every expert's down matrix; expert parallelism keeps whole experts (whole blocks).
    path = quantized_gguf("mixtral", "Q8_0")
    with pytest.raises(ConfigError) as err:
        LLM(str(path), use_tqdm_on_load=False, skip_tokenizer_init=True, tensor_parallel_size=2)
    assert "GGUF blocks of 32" in err.value.message
    assert "32 features of each expert" in err.value.message
    assert "--enable-expert-parallel" in err.value.hint


def test_an_unsupported_expert_type_names_the_supported_ones(quantized_gguf):
    path = quantized_gguf("mixtral", "Q5_0")
    with pytest.raises(UnsupportedQuantizationError) as err:
        LLM(str(path), use_tqdm_on_load=False, skip_tokenizer_init=True)
    assert "Q5_0" in err.value.message
    for supported in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        assert supported in err.value.hint


def test_each_expert_is_one_tensor_of_the_loading_progress(models):
    from llmctl.engine.model_loader.gguf_file import gguf_tensor_count, iterate_gguf_weights

    _, gguf_file, _ = models("qwen2-moe")
    names = [name for name, _ in iterate_gguf_weights(gguf_file, "qwen2moe", 4, 2)]
    assert gguf_tensor_count(gguf_file) == len(names) == len(set(names))
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in names  # 6 experts
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names


@pytest.mark.parametrize(
    "split",
    [{}, dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)],
    ids=["tp1", "tp2", "ep2"],
)
def test_the_plan_predicts_each_ranks_packed_experts_exactly(split, quantized_gguf):
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    path = str(quantized_gguf("mixtral-64", "Q8_0"))
    options = PlanOptions(
        device="cpu",
        kv_cache_space_gib=0.02,
        max_model_len=256,
        tensor_parallel_size=split.get("tensor_parallel_size"),
        enable_expert_parallel=split.get("enable_expert_parallel", False),
    )
    plan = make_plan(load_model_spec(path), inventory_from_flags(1, 2, 1), options)
    backend = {"distributed_executor_backend": "mp"} if split else {}
    with LLM(
        path,
        use_tqdm_on_load=False,
        kv_cache_space_gib=0.02,
        max_model_len=256,
        skip_tokenizer_init=True,
        **split,
        **backend,
    ) as llm:
        loaded = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
    assert [r.weight_bytes for r in plan.ranks] == loaded


def test_the_planner_and_the_engine_split_experts_blocks_alike(quantized_gguf):
    # The tiny Mixtral's experts of 32 features: tp=2 cuts their Q8_0 blocks, unless expert
    # parallelism keeps every expert whole.
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.engine.layers.quantization.quant_config import QuantizationConfig, check_group_split

    spec = load_model_spec(str(quantized_gguf("mixtral", "Q8_0")))
    formats, shape = spec.weight_formats, spec.shape
    assert formats.cut_groups(shape, 2) == ["down (16 of 32 inputs; groups of 32)"]
    assert formats.cut_groups(shape, 2, expert_parallel=True) == []
    quant = QuantizationConfig.for_gguf(["Q8_0", "F32"])
    with pytest.raises(ConfigError):
        check_group_split(shape, 2, quant)
    check_group_split(shape, 2, quant, expert_parallel=True)  # whole experts: accepted
