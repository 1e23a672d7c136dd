"""The model catalog: popular models' public config values, typed in so that planning works
offline and `--load-format dummy` runs a model's shape with no checkpoint at all.

Values from each model's config.json on the Hugging Face hub. `llmctl plan` reads an entry as a
ModelSpec (cluster/plan/catalog.py); the engine writes an entry's `config_json()` into a directory
and builds the model from it with random weights (model_loader/dummy.py). Pure: no torch, no
transformers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from llmctl.engine.config.architectures import ARCHITECTURE_BY_MODEL_TYPE
from llmctl.engine.config.model_shape import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelShape,
)

_MODEL_TYPES = {arch: model_type for model_type, arch in ARCHITECTURE_BY_MODEL_TYPE.items()}


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    shape: ModelShape
    dtype: str  # the checkpoint's
    # The published config.json itself, for the models typed in as their keys (MLA, FP8 ...)
    config: dict[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> CatalogEntry:
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        return cls(name, ModelShape.from_hf_config(config), dtype, config)

    def config_json(self) -> dict[str, Any]:
        """The entry as a Hugging Face config.json: ModelShape.from_hf_config reads `shape`
        back from it (tests/unit/test_model_catalog.py checks every entry)."""
        if self.config is not None:
            return copy.deepcopy(self.config)
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
                decoder_sparse_step=shape.decoder_sparse_step,
                mlp_only_layers=list(shape.mlp_only_layers),
                norm_topk_prob=shape.architecture == "Qwen3MoeForCausalLM",
            )
            if shape.moe_intermediate_size:  # (0: each expert as wide as the dense MLP)
                values["moe_intermediate_size"] = shape.moe_intermediate_size
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


def _every_6th_global(num_layers: int) -> tuple[str, ...]:
    return tuple(
        FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _alternating(num_layers: int) -> tuple[str, ...]:
    return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers))


_GPT_OSS = dict(
    architecture="GptOssForCausalLM", hidden_size=2880, num_heads=64, num_kv_heads=8,
    head_dim=64, intermediate_size=2880, vocab_size=201088, max_position_embeddings=131072,
    num_experts_per_tok=4, qkv_bias=True, o_bias=True, sliding_window=128,
    attention_sinks=True, moe_bias=True,
)  # fmt: skip


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
    _llama("Qwen3-8B", architecture="Qwen3ForCausalLM", num_layers=36, hidden_size=4096,
           num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
           vocab_size=151936, max_position_embeddings=40960, qk_norm=True),
    _llama("Qwen3-32B", architecture="Qwen3ForCausalLM", num_layers=64, hidden_size=5120,
           num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=25600,
           vocab_size=151936, max_position_embeddings=40960, qk_norm=True),
    # Gemma 3's text decoder: 1024-token windows, every 6th of its 62 layers global.
    _llama("Gemma-3-27B", architecture="Gemma3ForCausalLM", num_layers=62, hidden_size=5376,
           num_heads=32, num_kv_heads=16, head_dim=128, intermediate_size=21504,
           vocab_size=262208, max_position_embeddings=131072, tie_word_embeddings=True,
           qk_norm=True, sliding_window=1024, layer_types=_every_6th_global(62)),
    _llama("Phi-4", architecture="Phi3ForCausalLM", num_layers=40, hidden_size=5120,
           num_heads=40, num_kv_heads=10, head_dim=128, intermediate_size=17920,
           vocab_size=100352, max_position_embeddings=16384),
    # gpt-oss: 128-token windows on every other layer, sinks, biased experts; its published
    # checkpoints hold the experts in MXFP4, which the engine dequantizes as it reads them
    # (planned here at the dtype it serves them in).
    _llama("gpt-oss-20b", **_GPT_OSS, num_layers=24, num_experts=32,
           layer_types=_alternating(24)),
    _llama("gpt-oss-120b", **_GPT_OSS, num_layers=36, num_experts=128,
           layer_types=_alternating(36)),
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

_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}  # fmt: skip
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "max_position_embeddings": 163840, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "attention_bias": False, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16",
    "quantization_config": _FP8,
}  # fmt: skip
_CONFIGS = {
    "DeepSeek-V3": _DEEPSEEK_V3,
    "Kimi-K2": {
        **_DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
    },
    "GLM-4.5": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
        "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "n_routed_experts": 160, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
        "attention_bias": True, "use_qk_norm": True, "max_position_embeddings": 131072,
        "rope_theta": 1000000, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-235B-A22B-FP8": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "quantization_config": _FP8,
    },
}  # fmt: skip
_MODELS += [CatalogEntry.from_config(name, config) for name, config in _CONFIGS.items()]

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
    "qwen/qwen3-8b": "Qwen3-8B",
    "qwen/qwen3-32b": "Qwen3-32B",
    "google/gemma-3-27b-it": "Gemma-3-27B",
    "google/gemma-3-27b-pt": "Gemma-3-27B",
    "microsoft/phi-4": "Phi-4",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "qwen/qwen2.5-7b": "Qwen2.5-7B",
    "qwen/qwen2.5-72b": "Qwen2.5-72B",
    "facebook/opt-13b": "OPT-13B",
    "gpt2": "GPT-2",
    "openai-community/gpt2": "GPT-2",
    "huggingfacetb/smollm2-135m-instruct": "SmolLM2-135M-Instruct",
    "smollm2-135m": "SmolLM2-135M-Instruct",
    "deepseek-ai/deepseek-v3": "DeepSeek-V3",
    "deepseek-ai/deepseek-v3-0324": "DeepSeek-V3",
    "deepseek-ai/deepseek-r1": "DeepSeek-V3",
    "deepseek-r1": "DeepSeek-V3",
    "moonshotai/kimi-k2-instruct": "Kimi-K2",
    "moonshotai/kimi-k2-base": "Kimi-K2",
    "zai-org/glm-4.5": "GLM-4.5",
    "qwen/qwen3-235b-a22b-fp8": "Qwen3-235B-A22B-FP8",
}


def find_in_catalog(name: str) -> CatalogEntry | None:
    """The entry of a catalog name, a hub id or a short form (case-insensitive); None."""
    key = name.lower()
    for known in CATALOG:
        if known.lower() == key or known.lower().removesuffix("-instruct") == key:
            return CATALOG[known]
    alias = _ALIASES.get(key) or _ALIASES.get(key.removesuffix("-instruct"))
    return CATALOG.get(alias) if alias else None
