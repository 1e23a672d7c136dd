"""A model's RoPE settings, read from its Hugging Face config (pure: no torch).

transformers 5 writes `rope_parameters` (per layer type for Gemma 3); older configs wrote
`rope_theta` and `rope_scaling`. The rotary layers (layers/rotary_embedding.py) build their
tables from these settings; the scheduler reads `long_rope_threshold`.
"""

from __future__ import annotations

from typing import Any


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """The rope settings whichever transformers version wrote the config; with `layer_type`
    ("sliding_attention", "full_attention"), that type's own (Gemma 3)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        params = {"rope_type": "default"}
    if layer_type == "sliding_attention" and "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_local_base_freq", None) or 10000.0
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict) and layer_type != "sliding_attention":
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "su":  # Phi-3's early name
        params["rope_type"] = "longrope"
    for key in ("original_max_position_embeddings", "partial_rotary_factor"):
        if params.get(key) is None and getattr(hf_config, key, None) is not None:
            params[key] = getattr(hf_config, key)
    return params


def long_rope_threshold(hf_config: Any) -> int | None:
    """A LongRoPE model's original_max_position_embeddings: a request longer than that runs with
    the long factors, its KV computed again when it grows past it (as transformers does); None
    for any other rope."""
    if hf_config is None:
        return None
    params = rope_parameters(hf_config)
    if params["rope_type"] != "longrope":
        return None
    return int(params.get("original_max_position_embeddings") or 0) or None
