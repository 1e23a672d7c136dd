"""GGUFConfig: a GGUF file's metadata as a Hugging Face config.json, without transformers.

llama.cpp writes the model's config as metadata under its own key names. This module maps them
once, for the architectures llmctl converts (ModelShape's GGUF_ARCHITECTURES): the sizes through
ModelShape's GGUF table (`shape.hf_config_values()`, what the planner reads too), and the rest
here: the rope base and scaling, the norm epsilon, the special token ids, the activation.

The values equal what transformers' `load_gguf_checkpoint` + `AutoConfig.for_model` gave for the
keys the engine reads (tests/engine/test_gguf_config.py compares them on the bundled model and
on files of the other architectures), with three deliberate differences: a token id the file
does not give stays unset (transformers' LlamaConfig would say bos 1 and eos 2), linear rope
scaling is kept (transformers drops `rope.scaling.*`), and Mistral's sliding window is the file's
(MistralConfig's default 4096 would narrow the attention of a file that states none).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.engine.config.architectures import GGUF_ARCHITECTURES
from llmctl.engine.config.hf_config_view import HFConfigView
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.model_loader.gguf_moe import moe_config_values

logger = logging.getLogger("llmctl")

# GGUF architecture -> (transformers model_type, its config class).
_MODEL_TYPES = {
    "llama": ("llama", "LlamaConfig"),
    "mistral": ("mistral", "MistralConfig"),
    "qwen2": ("qwen2", "Qwen2Config"),
    "gpt2": ("gpt2", "GPT2Config"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeConfig"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeConfig"),
    "deepseek2": ("deepseek_v3", "DeepseekV3Config"),
    "qwen3": ("qwen3", "Qwen3Config"),
    "gemma3": ("gemma3_text", "Gemma3TextConfig"),
    "phi3": ("phi3", "Phi3Config"),
}
# llama.cpp's fixed Gemma 3 settings (its converter stores neither): the sliding layers' rope
# base, and query_pre_attn_scalar, head_dim except on the 62-layer 27B (hidden / heads).
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62
# A mixture of experts' model_type (gguf_moe.moe_config_values: a llama file with experts is
# Mixtral) -> its config class.
_MOE_CONFIG_CLASSES = {
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
}
# tokenizer.ggml.<key> -> config key
_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}
# GPT2Config's attribute_map: the generic names the view answers as well.
_GPT2_ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6  # LlamaConfig's, MistralConfig's and Qwen2Config's default
_DEFAULT_LAYER_NORM_EPS = 1e-5  # GPT2Config's


@dataclass(frozen=True)
class GGUFConfig:
    model_type: str  # transformers' model_type: llama, mistral, qwen2, gpt2
    config_class: str  # e.g. "LlamaConfig": what the view reports
    values: dict[str, Any]  # config.json's contents

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: tuple[str, ...],
        shape: ModelShape,
        tensors: Mapping[str, list[float]] | None = None,
    ) -> GGUFConfig:
        """From the file's metadata (gguf_file.read_gguf_metadata), its tensor names and the
        shape ModelShape.from_gguf_metadata read from them; `tensors`: the values of the small
        tensors a config carries (Phi-3's rope_factors_long / _short)."""
        arch = str(metadata["general.architecture"])
        model_type, config_class = _MODEL_TYPES[arch]
        key = lambda name: metadata.get(f"{arch}.{name}")  # noqa: E731
        values: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "model_type": model_type,
            "dtype": "float32",  # the quantized blocks dequantize to float32
        }
        values.update(shape.hf_config_values())
        moe = moe_config_values(arch, shape)  # {} for a dense model
        if moe:
            values.update(moe)
            model_type = moe["model_type"]
            config_class = _MOE_CONFIG_CLASSES[model_type]
        for gguf_key, name in _TOKEN_IDS.items():
            token_id = metadata.get(f"tokenizer.ggml.{gguf_key}")
            if token_id is not None:
                values[name] = int(token_id)
        if arch == "gpt2":
            eps = key("attention.layer_norm_epsilon")
            values["layer_norm_epsilon"] = _DEFAULT_LAYER_NORM_EPS if eps is None else float(eps)
            values["activation_function"] = "gelu_new"  # GPT2Config's default; GGUF names none
            return cls(model_type, config_class, values)
        eps = key("attention.layer_norm_rms_epsilon")
        values["rms_norm_eps"] = float(eps) if eps is not None else _DEFAULT_RMS_NORM_EPS
        values["rope_parameters"] = _rope_parameters(arch, metadata)
        values["hidden_act"] = "silu"
        if arch == "deepseek2":
            values.update(_deepseek2_values(metadata, shape))
            model_type = values["model_type"]
            config_class = "DeepseekV3Config" if model_type == "deepseek_v3" else "DeepseekV2Config"
        if arch == "llama":  # LlamaConfig's options (Qwen2's bias is its architecture's)
            values["attention_bias"] = False
            values["mlp_bias"] = False
        if arch == "mistral":
            values["sliding_window"] = shape.sliding_window
        if arch in ("qwen2", "qwen2moe", "qwen3moe", "qwen3"):
            values["use_sliding_window"] = False  # Qwen2Config's default, as transformers has it
            values["sliding_window"] = shape.sliding_window
        if arch == "qwen3":
            values["attention_bias"] = False
        if arch == "gemma3":
            values.update(_gemma3_values(metadata, shape))
        if arch == "phi3":
            values.update(_phi3_values(metadata, shape, tensors or {}))
        return cls(model_type, config_class, values)

    def view(self) -> HFConfigView:
        """The config as the engine and its workers read it (no transformers import)."""
        attributes = dict(self.values)
        if self.model_type == "gpt2":
            attributes.update({alias: self.values[name] for alias, name in _GPT2_ALIASES.items()})
        return HFConfigView(attributes, self.config_class)

    def save(self, directory: Path) -> None:
        """config.json (which transformers' AutoConfig reads as well) and the view beside it."""
        from llmctl.engine.model_loader.source import write_config_view

        (directory / "config.json").write_text(json.dumps(self.values, indent=2, sort_keys=True))
        write_config_view(self.view(), directory)


def _deepseek2_values(metadata: Mapping[str, Any], shape: ModelShape) -> dict[str, Any]:
    """DeepSeek-V2/V3's routing and YaRN as llama.cpp's deepseek2 records them: sigmoid gating
    (expert_gating_func 2, with exp_probs_b: V3's noaux_tc) or softmax (V2; grouped when
    expert_group_count > 1), expert_weights_scale/norm, and YaRN's mscale_all_dim from
    rope.scaling.yarn_log_multiplier (0.1 x mscale_all_dim; mscale is taken equal to it, as
    every DeepSeek checkpoint has them)."""
    key = lambda name: metadata.get(f"deepseek2.{name}")  # noqa: E731
    v3 = shape.architecture == "DeepseekV3ForCausalLM"
    groups = int(key("expert_group_count") or 1)
    values: dict[str, Any] = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "architectures": [shape.architecture],
        "routed_scaling_factor": float(key("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(key("expert_weights_norm") or False),
        "n_group": groups,
        "topk_group": int(key("expert_group_used_count") or groups),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
        "rope_interleave": True,  # llama.cpp's deepseek2 rotates adjacent pairs
        "attention_bias": False,
    }
    if key("rope.scaling.type") == "yarn":
        log_mul = key("rope.scaling.yarn_log_multiplier")
        mscale = float(log_mul) / 0.1 if log_mul else 1.0
        values["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": float(key("rope.freq_base") or _DEFAULT_ROPE_THETA),
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(key("rope.scaling.yarn_beta_fast") or 32),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow") or 1),
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
    return values


def _gemma3_values(metadata: Mapping[str, Any], shape: ModelShape) -> dict[str, Any]:
    """Gemma 3's keys: per-layer-type ropes, its window and pattern, query_pre_attn_scalar, the
    GELU-tanh MLP, tied embeddings, the final logit softcap when the file gives one."""
    scalar = shape.head_dim
    if shape.num_layers == _GEMMA3_27B_LAYERS:
        scalar = shape.hidden_size // shape.num_attention_heads
    softcap = metadata.get("gemma3.final_logit_softcapping")
    return {
        "rope_parameters": {
            "full_attention": _rope_parameters("gemma3", metadata),
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": _GEMMA3_LOCAL_ROPE_THETA,
            },
        },
        "sliding_window": shape.sliding_window,
        "layer_types": list(shape.layer_types) or None,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": float(softcap) if softcap is not None else None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


def _phi3_values(
    metadata: Mapping[str, Any], shape: ModelShape, tensors: Mapping[str, list[float]]
) -> dict[str, Any]:
    """Phi-3's rope: partial rotary from rope.dimension_count, LongRoPE from the file's
    rope_factors_long / _short tensors and its original context length; its window (0: none)."""
    rope = _rope_parameters("phi3", metadata)
    dims = metadata.get("phi3.rope.dimension_count")
    if dims is not None and int(dims) != shape.head_dim:
        rope["partial_rotary_factor"] = int(dims) / shape.head_dim
    original = metadata.get("phi3.rope.scaling.original_context_length")
    values: dict[str, Any] = {"sliding_window": shape.sliding_window, "attention_bias": False}
    if original is not None:
        values["original_max_position_embeddings"] = int(original)
        rope["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in tensors:
        rope.update(
            rope_type="longrope",
            long_factor=list(tensors["rope_factors_long.weight"]),
            short_factor=list(tensors["rope_factors_short.weight"]),
        )
    values["rope_parameters"] = rope
    return values


def _rope_parameters(arch: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    theta = metadata.get(f"{arch}.rope.freq_base")
    params: dict[str, Any] = {
        "rope_theta": float(theta) if theta is not None else _DEFAULT_ROPE_THETA,
        "rope_type": "default",
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor is not None:
        params.update(rope_type="linear", factor=float(factor))
    elif scaling not in (None, "none") and arch != "deepseek2":  # deepseek2: _deepseek2_values
        # llama.cpp's yarn/longrope settings have no counterpart in the engine's rotary layer
        # (transformers' GGUF mapping drops them too): the model runs with plain rope.
        logger.warning("GGUF rope scaling %r is not applied: the model runs plain rope", scaling)
    return params
