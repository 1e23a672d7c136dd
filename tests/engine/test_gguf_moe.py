"""Mixture-of-experts GGUF files (Mixtral as llama.cpp writes it: architecture `llama` with
experts; `qwen2moe` with its shared expert; `qwen3moe` with q/k norm): a tiny random model written
with gguf.GGUFWriter as llama.cpp lays it out (stacked ffn_*_exps expert tensors, Llama's q/k rows
permuted, the shared expert gate as a vector; experts in F16, the rest F32) generates token for
token what the same weights give from safetensors, in llmctl and in transformers; alone, and split
over two ranks by experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import random_prompts, tiny_configs, token_ids

from llmctl.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
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


def write_gguf(path, family: str, config, directory, experts: str = "F16") -> None:
    """`experts`: the stacked expert tensors' type (F16, or a quantized type such as Q8_0)."""
    import gguf

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
        if "_exps." in name and experts != "F16":
            qtype = gguf.GGMLQuantizationType[experts]
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


def test_a_quantized_moe_gguf_is_refused_naming_the_fix(models, tmp_path):
    from llmctl.engine.errors import ConfigError

    directory, _, _ = models("mixtral")
    path = tmp_path / "mixtral-q8_0.gguf"
    write_gguf(path, "mixtral", config_of("mixtral"), directory, experts="Q8_0")
    with pytest.raises(ConfigError) as err:
        LLM(str(path), use_tqdm_on_load=False, skip_tokenizer_init=True)
    assert "experts" in err.value.message and "quantization (gguf)" in err.value.message
    assert "float checkpoint" in err.value.hint


def test_each_expert_is_one_tensor_of_the_loading_progress(models):
    from llmctl.engine.model_loader.gguf_file import gguf_tensor_count, iterate_gguf_weights

    _, gguf_file, _ = models("qwen2-moe")
    names = [name for name, _ in iterate_gguf_weights(gguf_file, "qwen2moe", 4, 2)]
    assert gguf_tensor_count(gguf_file) == len(names) == len(set(names))
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in names  # 6 experts
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names
