"""The tokenizer of a model directory, read from local files only, and its stop token ids."""

from __future__ import annotations

import json
import os
from typing import Any

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.tokenizer.light_tokenizer import LightTokenizer


def get_tokenizer(path: str) -> Any:
    """A LightTokenizer where the directory's tokenizer.json says everything (no transformers
    import: seconds and ~200 MB less at start-up), else transformers' AutoTokenizer."""
    light = LightTokenizer.load(path)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: {exc}",
            "put the tokenizer files (tokenizer.json or vocab/merges) next to config.json, "
            "pass --tokenizer DIR, or, to send token ids only, --skip-tokenizer-init",
        ) from exc


def eos_token_ids(tokenizer: Any | None, model_path: str) -> frozenset[int]:
    """The tokenizer's EOS id plus those the model's generation_config.json lists.

    Without a tokenizer (skip_tokenizer_init), config.json's `eos_token_id` takes its place.
    """
    ids: set[int] = set()
    if tokenizer is None:
        ids |= _json_token_ids(os.path.join(model_path, "config.json"), "eos_token_id")
    elif tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids |= _json_token_ids(os.path.join(model_path, "generation_config.json"), "eos_token_id")
    return frozenset(ids)


def _json_token_ids(path: str, key: str) -> set[int]:
    """The token id(s) a JSON file gives under `key` (an int or a list of ints); none if absent."""
    if not os.path.isfile(path):
        return set()
    try:
        with open(path) as f:
            value = json.load(f).get(key)
    except (OSError, json.JSONDecodeError, AttributeError):
        return set()
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()
