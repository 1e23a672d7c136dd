"""Qwen3, Gemma 3 and Phi-3 from GGUF files laid out as llama.cpp's converter writes them (written
here with gguf.GGUFWriter from tiny random Hugging Face models): Qwen3's attn_q_norm / attn_k_norm;
Gemma 3's four norms per layer, stored plus one, its window and 1-in-6 global layers, the
sliding layers' fixed rope base; Phi-3's fused attn_qkv and ffn_up ([gate | up]), partial rotary
(rope.dimension_count) and LongRoPE factors as tensors. Each file also carries a byte-level
tokenizer and a chat template.

- In float32 the file generates what the safetensors checkpoint does in transformers (token for
  token): names, layouts, the norm shift and the config read back right.
- Quantized (Q8_0, Q4_0), its blocks run natively and give the tokens of llmctl's float path on
  the dequantized weights (or, where accumulation order parts them, a first difference whose
  reference logit gap is below 1e-3, printed).
- The chat template is the file's, and the planner predicts the packed weights exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import CHAT_TEMPLATE, byte_level_metadata
from support import assert_same_greedy, random_prompts, token_ids

from llmctl.engine import LLM, SamplingParams

VOCAB = 4002  # byte_level_metadata(size=4000): 4000 tokens and two added ones
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
FAMILIES = ["qwen3", "gemma3", "phi3"]
GGUF_ARCH = {"qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}
# Hugging Face module name -> llama.cpp tensor name, per layer
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_NAMES = LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def config_of(family: str):
    """Tiny configs within what a GGUF states: Gemma 3 as llama.cpp fixes it (every 6th layer
    global, local rope base 1e4, query_pre_attn_scalar = head_dim); Phi-3 with LongRoPE past 24
    tokens on half of each head."""
    from transformers import Gemma3TextConfig, Phi3Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    if family == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=2)
    if family == "gemma3":
        return Gemma3TextConfig(
            **common,
            num_hidden_layers=6,
            sliding_window=12,
            query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    return Phi3Config(
        **common,
        num_hidden_layers=2,
        pad_token_id=0,
        original_max_position_embeddings=24,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [20.0, 40.0, 80.0, 160.0],
            "original_max_position_embeddings": 24,
        },
    )


def gguf_tensors(family: str, model) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names (Gemma 3's norms plus one)."""
    names = GEMMA3_NAMES if family == "gemma3" else LAYER_NAMES
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    out = {}
    for name, w in model.state_dict().items():
        w = w.float().numpy()
        base, kind = name.rsplit(".", 1)
        if base == "lm_head" and model.config.tie_word_embeddings:
            continue
        if base in top:
            gguf_name = f"{top[base]}.{kind}"
        else:
            _, _, layer, rest = base.split(".", 3)
            gguf_name = f"blk.{layer}.{names[rest]}.{kind}"
        if family == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        out[gguf_name] = w
    if family == "phi3":
        rope = model.config.rope_parameters
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return out


def write_gguf(path, family: str, model, quant: str) -> None:
    """`quant`: F32, or a type every matrix is quantized to (norms and factors stay F32)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[family])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if family == "gemma3":
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if family == "phi3":
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(config.head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(0)
    for key, value in byte_level_metadata("qwen2", size=VOCAB - 2).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, w in gguf_tensors(family, model).items():
        if quant == "F32" or w.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[quant]
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(family, type) -> (GGUF file, the Hugging Face model whose weights it holds)."""
    from support import _perturb
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf-new-families")
    models, cache = {}, {}

    def get(family: str, quant: str):
        if family not in models:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config_of(family)).eval()
            _perturb(model)
            models[family] = model
        if (family, quant) not in cache:
            path = root / f"{family}-{quant}.gguf"
            write_gguf(path, family, models[family], quant)
            cache[family, quant] = path
        return cache[family, quant], models[family]

    return get


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))


def prompts() -> list[list[int]]:
    # up to 30 tokens + 16: Gemma 3's window of 12 passed, Phi-3's 24 crossed and started past
    return [[t % VOCAB for t in p] for p in random_prompts([5, 11, 20, 30], seed=21)]


def _llm(path, **kwargs) -> LLM:
    return LLM(
        str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02, **kwargs
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_float_gguf_generates_what_transformers_does(family, files, hf_greedy):
    path, hf_model = files(family, "F32")
    with _llm(path) as llm:
        got = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
        assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE  # the file's
        chat = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    tokens = byte_level_metadata("qwen2", size=VOCAB - 2)["tokenizer.ggml.tokens"]
    assert chat == f"{tokens[1]}[user] hi{tokens[2]}[assistant] "  # BOS, EOS: ids 1 and 2
    assert got == [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts()]


@pytest.mark.parametrize(
    "family, quant", [("qwen3", "Q4_0"), ("qwen3", "Q8_0"), ("gemma3", "Q4_0"), ("gemma3", "Q8_0")]
)
def test_quantized_blocks_run_natively_as_the_float_path(family, quant, files):
    path, _ = files(family, quant)
    with _llm(path) as llm:
        assert llm.llm_engine.config.model_config.quantization.gguf_types == (quant,)
        native = llm.generate(prompts(), GREEDY, use_tqdm=False)
    with _llm(path, gguf_dequantize=True) as llm:
        assert llm.llm_engine.config.model_config.quantization is None
        reference = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_greedy(native, reference)


def test_a_quantized_phi3_splits_its_fused_blocks_over_two_ranks(files):
    """Phi-3's fused qkv and gate_up rows are each rank's heads and features, in their Q8_0
    blocks; and the plan counts each rank's packed bytes as the engine holds them."""
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    path, _ = files("phi3", "Q8_0")
    split = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    with _llm(path, **split) as llm:
        native = llm.generate(prompts(), GREEDY, use_tqdm=False)
        loaded = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
    with _llm(path, gguf_dequantize=True) as llm:
        reference = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_greedy(native, reference)
    options = PlanOptions(
        device="cpu", dtype="float32", kv_cache_space_gib=0.02, tensor_parallel_size=2
    )
    plan = make_plan(load_model_spec(str(path)), inventory_from_flags(1, 2, 1), options)
    assert [r.weight_bytes for r in plan.ranks] == loaded
