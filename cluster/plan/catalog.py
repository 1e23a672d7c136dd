"""The model catalog as the planner reads it: each entry of engine/config/model_catalog.py (the
typed-in public configs, which the engine's `--load-format dummy` runs too) as a ModelSpec."""

from __future__ import annotations

from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.engine.config import model_catalog


def _spec(entry: model_catalog.CatalogEntry) -> ModelSpec:
    if entry.config is not None:  # its quantization_config (FP8) read as a checkpoint's is
        return ModelSpec.from_config(entry.config, entry.name)
    return ModelSpec(name=entry.name, shape=entry.shape, dtype=entry.dtype)


CATALOG: dict[str, ModelSpec] = {name: _spec(e) for name, e in model_catalog.CATALOG.items()}


def find_in_catalog(name: str) -> ModelSpec | None:
    entry = model_catalog.find_in_catalog(name)
    return None if entry is None else CATALOG[entry.name]
