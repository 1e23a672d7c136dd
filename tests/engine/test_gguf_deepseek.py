"""DeepSeek-V3 from GGUF as llama.cpp's converter writes it (architecture deepseek2: MLA as
multi-query attention over the latent, kv_b_proj split into attn_k_b, each head's rows
transposed, and attn_v_b; stacked experts, shared experts as ffn_*_shexp, the routing bias as
exp_probs_b; YaRN's mscale as yarn_log_multiplier), its matrices in Q8_0: they run natively in
their blocks and give the tokens of llmctl's float path on the dequantized file (or, where
accumulation order parts them, a first difference whose logit gap is below 1e-3), which are
transformers' on the same round-tripped weights; alone and at tp=2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import VOCAB, assert_same_greedy, random_prompts, spread_routers, token_ids

from llmctl.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
PROMPTS = random_prompts([5, 11, 20, 3], seed=3)
Q8_0 = ("token_embd", "output", "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_output",
        "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
        "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")  # fmt: skip
NAMES = {  # Hugging Face module -> llama.cpp tensor, per layer
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def config():
    """Every matrix's inputs whole Q8_0 blocks of 32, on two ranks too; YaRN; sigmoid routing
    over 2 of 4 groups."""
    from transformers import DeepseekV3Config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
        routed_scaling_factor=2.5, max_position_embeddings=256, rope_parameters=yarn,
    )  # fmt: skip


def llama_cpp_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's deepseek2 names and layouts."""
    cfg = model.config
    out = {}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, w in model.state_dict().items():
        w = w.numpy()
        base, kind = name.rsplit(".", 1)
        if base in top:
            out[f"{top[base]}.{kind}"] = w
            continue
        _, _, layer, rest = base.split(".", 3)
        if rest == "mlp.gate" and kind == "e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = w
        elif rest == "mlp.experts" and kind == "gate_up_proj":
            inter = cfg.moe_intermediate_size  # transformers holds [E, 2I, H]: gate, then up
            out[f"blk.{layer}.ffn_gate_exps.weight"] = w[:, :inter]
            out[f"blk.{layer}.ffn_up_exps.weight"] = w[:, inter:]
        elif rest == "mlp.experts" and kind == "down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = w
        elif rest == "self_attn.kv_b_proj":  # split, k_b's rows transposed per head
            heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = w.reshape(heads, nope + v, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(
                kv_b[:, :nope].transpose(0, 2, 1)
            )
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        else:
            out[f"blk.{layer}.{NAMES[rest]}.{kind}"] = w
    return out


def write_deepseek2_gguf(path, model) -> dict[str, np.ndarray]:
    """The GGUF file; returns each tensor as the file holds it, dequantized."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)  # MLA as multi-query attention over the latent
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    held = {}
    for name, w in llama_cpp_tensors(model).items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if name.split(".")[-2] in Q8_0:
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            held[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
        elif name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            writer.add_tensor(name, w.astype(np.float16))
            held[name] = w.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(name, w)
            held[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


@pytest.fixture(scope="module")
def deepseek_gguf(tmp_path_factory, hf_greedy):
    """(GGUF file, transformers' tokens on the weights as the file holds them)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf-deepseek")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval()
    spread_routers(model)
    path = root / "deepseek-v3.gguf"
    held = write_deepseek2_gguf(path, model)
    # transformers on the round trip: the dequantized file's values in the model's own layout
    cfg, state = model.config, model.state_dict()
    for i in range(cfg.num_hidden_layers):
        k_b, v_b = held.pop(f"blk.{i}.attn_k_b.weight"), held.pop(f"blk.{i}.attn_v_b.weight")
        kv_b = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
        state[f"model.layers.{i}.self_attn.kv_b_proj.weight"].copy_(
            torch.from_numpy(kv_b.reshape(-1, cfg.kv_lora_rank))
        )
    names = {gguf_name: hf for hf, gguf_name in NAMES.items()}
    for name, w in held.items():
        parts = name.split(".")
        if parts[0] != "blk":
            hf = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}[parts[0]]  # fmt: skip
            state[f"{hf}.weight"].copy_(torch.from_numpy(w.reshape(state[f"{hf}.weight"].shape)))
            continue
        layer, part = parts[1], parts[2]
        if part == "exp_probs_b":
            state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].copy_(
                torch.from_numpy(w)
            )
        elif part in EXPERTS.values():
            role = {v: k for k, v in EXPERTS.items()}[part]
            stacked = w.reshape(cfg.n_routed_experts, -1, w.shape[-1])
            for e in range(cfg.n_routed_experts):
                target = model.model.layers[int(layer)].mlp.experts
                rows = torch.from_numpy(stacked[e])
                if role == "down_proj":
                    target.down_proj.data[e].copy_(rows)
                else:
                    inter = cfg.moe_intermediate_size
                    start = 0 if role == "gate_proj" else inter
                    target.gate_up_proj.data[e, start : start + inter].copy_(rows)
        else:
            key = f"model.layers.{layer}.{names[part]}.{parts[3]}"
            state[key].copy_(torch.from_numpy(w.reshape(state[key].shape)))
    return path, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def generate(path, **kwargs):
    with LLM(str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02,
             skip_tokenizer_init=True, **kwargs) as llm:  # fmt: skip
        quantization = llm.llm_engine.config.model_config.quantization
        weights = [r["weight_bytes"] for r in llm.llm_engine.executor.rank_info()]
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False), quantization, weights


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))


def test_deepseek_v3_gguf_runs_its_blocks_natively(deepseek_gguf):
    path, expected = deepseek_gguf
    from llmctl.cluster.inventory import inventory_from_flags
    from llmctl.cluster.plan.model_spec import load_model_spec
    from llmctl.cluster.plan.planner import PlanOptions, make_plan

    spec = load_model_spec(str(path))
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.shape.kv_lora_rank == 32
    reference, float_quant, _ = generate(path, gguf_dequantize=True)
    assert float_quant is None
    assert token_ids(reference) == expected  # the file read right: transformers' tokens
    native, quantization, _ = generate(path)
    assert quantization.method == "gguf" and quantization.gguf_types == ("Q8_0",)
    assert_same_greedy(native, reference)
    # two ranks: every split layer's inputs whole Q8_0 blocks (64 expert features: 32 a rank)
    native_split, _, weights = generate(
        path, tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    assert_same_greedy(native_split, reference)
    plan = make_plan(
        spec,
        inventory_from_flags(1, 2, 1),
        PlanOptions(device="cpu", dtype="float32", kv_cache_space_gib=0.02, tensor_parallel_size=2),
    )
    assert [r.weight_bytes for r in plan.ranks] == weights  # the Q8_0 blocks as packed
