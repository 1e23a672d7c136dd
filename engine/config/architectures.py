"""The architectures llmctl runs: the family whose layer structure each shares, and the names
that lead to them (config.json's model_type, GGUF's general.architecture and metadata keys).
A new model family starts here (docs/architecture.md). Pure: no torch, no transformers.
"""

from __future__ import annotations

# Hugging Face architecture -> the family whose layer structure it shares.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "Glm4MoeForCausalLM": "llama",
    "DeepseekV2ForCausalLM": "llama",  # multi-head latent attention: ModelShape.is_mla
    "DeepseekV3ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "GptOssForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
    "GPT2LMHeadModel": "gpt2",
    "OPTForCausalLM": "opt",
}
# config.json's model_type -> architecture, for configs that name no `architectures`.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "opt": "OPTForCausalLM",
}
# GGUF `general.architecture` -> Hugging Face architecture (the ones llmctl converts).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "deepseek2": "DeepseekV3ForCausalLM",  # V2 when its experts are gated by softmax
}
# GGUF metadata key (after the "<arch>." prefix) -> ModelShape field.
GGUF_KEYS = {
    "block_count": "num_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attention.sliding_window": "sliding_window",
}
# Mixtures of experts: their MLPs are FusedMoE layers (engine/layers/fused_moe.py).
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
)
QK_NORM_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
