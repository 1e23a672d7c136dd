"""Model registry: the config's `architectures` name -> the class that implements it."""

from __future__ import annotations

import importlib

from llmctl.engine.errors import UnsupportedArchitectureError

# architecture -> (module under llmctl.engine.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"model architecture {architecture!r} is not supported",
            f"llmctl runs {', '.join(supported_architectures())}",
        )


def get_model_class(architecture: str) -> type:
    check_architecture(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"llmctl.engine.models.{module}"), name)
