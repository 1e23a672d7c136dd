"""DeepSeek-V2/V3's shape (Kimi-K2 is DeepseekV3ForCausalLM): multi-head latent attention and
its mixture of experts, as ModelShape holds them (pure: no torch).

Multi-head latent attention (MLA) projects each token's hidden state to a latent of kv_lora_rank
features (normalized) plus one rope key of qk_rope_head_dim shared by every head; the cache keeps
only these, (kv_lora_rank + qk_rope_head_dim) values a token and layer, whole on every
tensor-parallel rank. Per attention head, kv_b_proj expands the latent into a key of
qk_nope_head_dim (to which the rope key is appended) and a value of v_head_dim. Queries come from
q_proj, or through a low-rank q_a_proj, its RMSNorm and q_b_proj (q_lora_rank). Tensor parallel
splits the heads: q_proj / q_b_proj and kv_b_proj by their rows, o_proj by its inputs; the latent
projection kv_a_proj_with_mqa (and q_a_proj) are replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmctl.engine.config.model_shape import ModelShape

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def mla_shape_values(get, arch: str) -> dict[str, Any]:
    """ModelShape's fields (but the architecture) from a DeepSeek config's getter."""
    from llmctl.engine.config.model_shape import _max_positions

    nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    heads = get("num_attention_heads")
    moe_inter = get("moe_intermediate_size") or 0
    num_experts = get("n_routed_experts") or 0
    bias = bool(get("attention_bias", False))
    return dict(
        num_layers=get("num_hidden_layers"),
        hidden_size=get("hidden_size"),
        num_attention_heads=heads,
        num_kv_heads=heads,  # every head reads the one latent: heads split like MHA's
        head_dim=(nope or 0) + (rope or 0) or None,
        intermediate_size=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        max_position_embeddings=_max_positions(get),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=bias,  # q_a_proj's and kv_a_proj_with_mqa's
        o_bias=bias,
        mlp_bias=bool(get("mlp_bias", False)),
        kv_lora_rank=get("kv_lora_rank") or 0,
        q_lora_rank=get("q_lora_rank") or 0,
        qk_nope_head_dim=nope or 0,
        qk_rope_head_dim=rope or 0,
        v_head_dim=get("v_head_dim") or 0,
        num_experts=num_experts,
        num_experts_per_tok=(get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=moe_inter * (get("n_shared_experts") or 0),
        shared_expert_gate=False,
        first_k_dense_replace=get("first_k_dense_replace") or 0,
        # V3's sigmoid routing adds a learned bias per expert (noaux_tc); V2 routes by softmax
        expert_score_bias=arch == "DeepseekV3ForCausalLM" or get("topk_method") == "noaux_tc",
    )


def check_mla_shape(shape: ModelShape) -> None:
    """ConfigError for an MLA config missing one of its sizes."""
    from llmctl.engine.errors import ConfigError

    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(shape, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{shape.architecture}: {name} must be a positive integer, got {value!r}",
                "fix the model's config.json",
            )
    if shape.qk_rope_head_dim % 2:
        raise ConfigError(
            f"{shape.architecture}: qk_rope_head_dim={shape.qk_rope_head_dim} is odd; rotary "
            "embeddings rotate pairs",
            "fix the model's config.json",
        )


def mla_attention_params(shape: ModelShape, num_q_heads: int) -> int:
    """One MLA layer's attention on a rank computing `num_q_heads` heads: the query path
    (q_proj, or q_a_proj + its norm + q_b_proj), the replicated latent projection and its norm,
    this rank's rows of kv_b_proj and inputs of o_proj; with attention_bias, q_a_proj's,
    kv_a_proj_with_mqa's and o_proj's biases."""
    h, qk = shape.hidden_size, shape.qk_nope_head_dim + shape.qk_rope_head_dim
    latent = shape.kv_lora_rank + shape.qk_rope_head_dim
    if shape.q_lora_rank:
        params = h * shape.q_lora_rank + shape.q_lora_rank + shape.q_lora_rank * num_q_heads * qk
        params += shape.q_lora_rank if shape.qkv_bias else 0
    else:
        params = h * num_q_heads * qk
    params += h * latent + shape.kv_lora_rank + (latent if shape.qkv_bias else 0)
    params += shape.kv_lora_rank * num_q_heads * (shape.qk_nope_head_dim + shape.v_head_dim)
    params += num_q_heads * shape.v_head_dim * h + (h if shape.o_bias else 0)
    return params


# -- GGUF: llama.cpp's deepseek2 -------------------------------------------------------------


def mla_gguf_values(metadata, tensor_names: tuple[str, ...] | None) -> dict[str, Any]:
    """ModelShape's fields (but the architecture) of a GGUF file of architecture deepseek2, as
    llama.cpp's converter writes DeepSeek-V2/V3 and Kimi-K2: MLA as multi-query attention over
    the latent (head_count_kv 1, key_length kv_lora_rank + rope), the per-head sizes in
    key_length_mla / value_length_mla (files from before those keys: key_length and
    value_length)."""

    def key(name: str, default=None):
        value = metadata.get(f"deepseek2.{name}")
        return default if value is None else int(value)

    heads, rope = key("attention.head_count"), key("rope.dimension_count")
    qk = key("attention.key_length_mla") or key("attention.key_length")
    v = key("attention.value_length_mla") or key("attention.value_length")
    names = tensor_names or ()
    moe_inter = key("expert_feed_forward_length", 0)
    vocab = key("vocab_size")
    if vocab is None:
        from llmctl.engine.config.model_shape import GGUF_TOKENS

        tokens = metadata.get(GGUF_TOKENS)
        vocab = tokens if isinstance(tokens, int) or tokens is None else len(tokens)
    return dict(
        num_layers=key("block_count"),
        hidden_size=key("embedding_length"),
        num_attention_heads=heads,
        num_kv_heads=heads,
        head_dim=qk,
        intermediate_size=key("feed_forward_length"),
        vocab_size=vocab,
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings=tensor_names is not None and "output.weight" not in names,
        kv_lora_rank=key("attention.kv_lora_rank", 0),
        q_lora_rank=key("attention.q_lora_rank", 0),
        qk_nope_head_dim=(qk or 0) - (rope or 0),
        qk_rope_head_dim=rope or 0,
        v_head_dim=v or 0,
        num_experts=key("expert_count", 0),
        num_experts_per_tok=key("expert_used_count", 0),
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=moe_inter * key("expert_shared_count", 0),
        shared_expert_gate=False,
        first_k_dense_replace=key("leading_dense_block_count", 0),
        expert_score_bias=any(n.endswith(".exp_probs_b.bias") for n in names)
        or key("expert_gating_func") == 2,
    )


def mla_hf_config_values(shape: ModelShape) -> dict[str, Any]:
    """A DeepSeek shape's sizes in config.json's keys (the GGUF converter writes these)."""
    return {
        "num_hidden_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "kv_lora_rank": shape.kv_lora_rank,
        "q_lora_rank": shape.q_lora_rank or None,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "n_routed_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "n_shared_experts": shape.shared_expert_intermediate_size
        // max(shape.moe_intermediate_size, 1),
        "first_k_dense_replace": shape.first_k_dense_replace,
    }
