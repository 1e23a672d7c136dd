"""The model catalog (engine/config/model_catalog.py): each entry's config.json, read back by
transformers and ModelShape, is the entry's shape (what --load-format dummy builds from a catalog
name, and what `llmctl plan` plans)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmctl.cluster.plan.catalog import CATALOG as PLAN_CATALOG
from llmctl.cluster.plan.catalog import find_in_catalog as plan_find
from llmctl.engine.config.model_catalog import CATALOG, find_in_catalog
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.model_loader.source import ModelSource


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_config_json_reads_back_as_the_entry_shape(name, tmp_path):
    entry = CATALOG[name]
    (tmp_path / "config.json").write_text(json.dumps(entry.config_json()))
    # read as the engine's loader reads it (Kimi-K2's kimi_k2 by transformers' DeepSeek-V3 class)
    config = ModelSource(path=str(tmp_path), display_name=name).load_hf_config()

    shape = ModelShape.from_hf_config(config)

    differences = {
        f.name: (getattr(shape, f.name), getattr(entry.shape, f.name))
        for f in dataclasses.fields(shape)
        if getattr(shape, f.name) != getattr(entry.shape, f.name)
    }
    assert not differences


def test_hub_ids_and_short_forms_find_entries():
    assert find_in_catalog("meta-llama/Llama-3.1-8B").name == "Llama-3.1-8B"
    assert find_in_catalog("smollm2-135m").name == "SmolLM2-135M-Instruct"
    assert find_in_catalog("no-such-model") is None


def test_the_planner_reads_the_same_entries():
    assert set(PLAN_CATALOG) == set(CATALOG)
    spec = plan_find("Llama-3.1-70B")
    assert spec.shape == CATALOG["Llama-3.1-70B"].shape
    assert spec.dtype == "bfloat16"
