"""The tokenizer of a model directory, read from local files only, and its stop token ids."""

from __future__ import annotations

import json
import os
from typing import Any

from llmctl.engine.errors import ModelLoadError


def get_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: {exc}",
            "put the tokenizer files (tokenizer.json or vocab/merges) next to config.json, "
            "or pass --tokenizer DIR",
        ) from exc


def eos_token_ids(tokenizer: Any, model_path: str) -> frozenset[int]:
    """The tokenizer's EOS id plus those the model's generation_config.json lists."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(generation_config):
        try:
            with open(generation_config) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            value = None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)
