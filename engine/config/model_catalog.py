"""The model catalog: popular models' public config values, typed in so that planning works
offline and `--load-format dummy` runs a model's shape with no checkpoint at all.

Values from each model's config.json on the Hugging Face hub. `llmctl plan` reads an entry as a
ModelSpec (cluster/plan/catalog.py); the engine writes an entry's `config_json()` into a directory
and builds the model from it with random weights (model_loader/dummy.py). Pure: no torch, no
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmctl.engine.config.model_shape import ARCHITECTURE_BY_MODEL_TYPE, ModelShape

_MODEL_TYPES = {arch: model_type for model_type, arch in ARCHITECTURE_BY_MODEL_TYPE.items()}


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    shape: ModelShape
    dtype: str  # the checkpoint's

    def config_json(self) -> dict[str, Any]:
        """The entry as a Hugging Face config.json: ModelShape.from_hf_config reads `shape`
        back from it (tests/unit/test_model_catalog.py checks every entry)."""
        shape = self.shape
        values: dict[str, Any] = {
            "architectures": [shape.architecture],
            "model_type": _MODEL_TYPES[shape.architecture],
            "torch_dtype": self.dtype,
            **shape.hf_config_values(),
        }
        if shape.family == "opt":
            values.update(
                ffn_dim=shape.intermediate_size,
                word_embed_proj_dim=shape.embedding_width,
                enable_bias=shape.qkv_bias,
                do_layer_norm_before=True,
            )
            return values
        if shape.family == "gpt2":
            return values
        values.update(
            hidden_act="silu",
            rms_norm_eps=1e-5,
            attention_bias=shape.o_bias,
            mlp_bias=shape.mlp_bias,
            sliding_window=shape.sliding_window,
        )
        if shape.architecture.startswith("Qwen"):
            values["use_sliding_window"] = shape.sliding_window is not None
        if shape.architecture == "MixtralForCausalLM":
            values.update(num_local_experts=shape.num_experts)
        elif shape.num_experts:
            values.update(
                num_experts=shape.num_experts,
                moe_intermediate_size=shape.expert_intermediate_size,
                decoder_sparse_step=shape.decoder_sparse_step,
                mlp_only_layers=list(shape.mlp_only_layers),
                norm_topk_prob=shape.architecture == "Qwen3MoeForCausalLM",
            )
            if shape.shared_expert_intermediate_size:
                values["shared_expert_intermediate_size"] = shape.shared_expert_intermediate_size
        if shape.num_experts:
            values["num_experts_per_tok"] = shape.num_experts_per_tok
        return values


def _model(name: str, architecture: str, dtype: str, **shape) -> CatalogEntry:
    """A catalog entry: its name, its checkpoint's dtype and its ModelShape."""
    shape["num_attention_heads"] = shape.pop("num_heads")
    return CatalogEntry(
        name=name, shape=ModelShape(architecture=architecture, **shape), dtype=dtype
    )


def _llama(name: str, **kw) -> CatalogEntry:
    values = dict(architecture="LlamaForCausalLM", tie_word_embeddings=False, dtype="bfloat16")
    values.update(kw)
    return _model(name, **values)


_MODELS = [
    _llama("Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
           head_dim=128, intermediate_size=14336, vocab_size=128256,
           max_position_embeddings=131072),
    _llama("Llama-3.1-70B", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
           head_dim=128, intermediate_size=28672, vocab_size=128256,
           max_position_embeddings=131072),
    _llama("Llama-3.1-405B", num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
           head_dim=128, intermediate_size=53248, vocab_size=128256,
           max_position_embeddings=131072),
    _llama("Llama-2-7B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
           head_dim=128, intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
           dtype="float16"),
    _llama("Llama-2-13B", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
           head_dim=128, intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096,
           dtype="float16"),
    _llama("Llama-2-70B", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
           head_dim=128, intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096,
           dtype="float16"),
    _llama("Mistral-7B", architecture="MistralForCausalLM", num_layers=32, hidden_size=4096,
           num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
           max_position_embeddings=32768, sliding_window=4096),
    _llama("Mixtral-8x7B", architecture="MixtralForCausalLM", num_layers=32, hidden_size=4096,
           num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
           max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2),
    _llama("Mixtral-8x22B", architecture="MixtralForCausalLM", num_layers=56, hidden_size=6144,
           num_heads=48, num_kv_heads=8, head_dim=128, intermediate_size=16384, vocab_size=32768,
           max_position_embeddings=65536, num_experts=8, num_experts_per_tok=2),
    _llama("Qwen1.5-MoE-A2.7B", architecture="Qwen2MoeForCausalLM", num_layers=24,
           hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=128, intermediate_size=5632,
           vocab_size=151936, max_position_embeddings=8192, qkv_bias=True, num_experts=60,
           num_experts_per_tok=4, moe_intermediate_size=1408,
           shared_expert_intermediate_size=5632),
    _llama("Qwen3-30B-A3B", architecture="Qwen3MoeForCausalLM", num_layers=48, hidden_size=2048,
           num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
           vocab_size=151936, max_position_embeddings=40960, num_experts=128,
           num_experts_per_tok=8, moe_intermediate_size=768, qk_norm=True),
    _llama("Qwen2.5-7B", architecture="Qwen2ForCausalLM", num_layers=28, hidden_size=3584,
           num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
           vocab_size=152064, max_position_embeddings=32768, qkv_bias=True),
    _llama("Qwen2.5-72B", architecture="Qwen2ForCausalLM", num_layers=80, hidden_size=8192,
           num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=29568,
           vocab_size=152064, max_position_embeddings=32768, qkv_bias=True),
    _model("OPT-13B", "OPTForCausalLM", num_layers=40, hidden_size=5120, num_heads=40,
           num_kv_heads=40, head_dim=128, intermediate_size=20480, vocab_size=50272,
           max_position_embeddings=2048, tie_word_embeddings=True, dtype="float16",
           word_embed_proj_dim=5120, qkv_bias=True, o_bias=True, mlp_bias=True),
    _model("GPT-2", "GPT2LMHeadModel", num_layers=12, hidden_size=768, num_heads=12,
           num_kv_heads=12, head_dim=64, intermediate_size=3072, vocab_size=50257,
           max_position_embeddings=1024, tie_word_embeddings=True, dtype="float32",
           qkv_bias=True, o_bias=True, mlp_bias=True),
    _llama("SmolLM2-135M-Instruct", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
           head_dim=64, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
           tie_word_embeddings=True),
]  # fmt: skip

CATALOG: dict[str, CatalogEntry] = {m.name: m for m in _MODELS}
# Names people type: hub ids and short forms.
_ALIASES = {
    "meta-llama/llama-3.1-8b": "Llama-3.1-8B",
    "meta-llama/llama-3.1-70b": "Llama-3.1-70B",
    "meta-llama/llama-3.1-405b": "Llama-3.1-405B",
    "meta-llama/llama-2-7b-hf": "Llama-2-7B",
    "meta-llama/llama-2-13b-hf": "Llama-2-13B",
    "meta-llama/llama-2-70b-hf": "Llama-2-70B",
    "mistralai/mistral-7b-v0.1": "Mistral-7B",
    "mistralai/mixtral-8x7b-v0.1": "Mixtral-8x7B",
    "mistralai/mixtral-8x22b-v0.1": "Mixtral-8x22B",
    "qwen/qwen1.5-moe-a2.7b": "Qwen1.5-MoE-A2.7B",
    "qwen/qwen3-30b-a3b": "Qwen3-30B-A3B",
    "qwen/qwen2.5-7b": "Qwen2.5-7B",
    "qwen/qwen2.5-72b": "Qwen2.5-72B",
    "facebook/opt-13b": "OPT-13B",
    "gpt2": "GPT-2",
    "openai-community/gpt2": "GPT-2",
    "huggingfacetb/smollm2-135m-instruct": "SmolLM2-135M-Instruct",
    "smollm2-135m": "SmolLM2-135M-Instruct",
}


def find_in_catalog(name: str) -> CatalogEntry | None:
    """The entry of a catalog name, a hub id or a short form (case-insensitive); None."""
    key = name.lower()
    for known in CATALOG:
        if known.lower() == key or known.lower().removesuffix("-instruct") == key:
            return CATALOG[known]
    alias = _ALIASES.get(key) or _ALIASES.get(key.removesuffix("-instruct"))
    return CATALOG.get(alias) if alias else None
