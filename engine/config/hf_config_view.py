"""HFConfigView: a Hugging Face config's attributes as plain data, for worker processes.

A pickled `LlamaConfig` names its class, so unpickling it in a fresh worker process imports
transformers' configuration machinery, which pulls in torch._dynamo, sympy and
torch.distributed.tensor: about 3.5 s of CPU per worker on a 2-core machine, before the worker
does any work. Workers only read attributes of the config (the model classes build their layers
from them), so the executors send them this view instead; the engine process keeps the real
config.

The view holds every attribute the config answers with plain data (numbers, strings, None,
and lists, tuples and dicts of those, and torch dtypes): the instance attributes, the aliases
of `attribute_map` (GPT-2's `hidden_size` is `n_embd`) and the values of the class's
properties (`rope_scaling`). A missing attribute raises AttributeError, as on the config.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmctl.engine.config.engine_config import EngineConfig


class HFConfigView:
    def __init__(self, attributes: dict[str, Any], config_class: str) -> None:
        self.__dict__.update(attributes)
        self._config_class = config_class  # e.g. "LlamaConfig"

    @classmethod
    def of(cls, config: Any) -> Any:
        """The view of a Hugging Face config (a view or None is returned as it is)."""
        if config is None or isinstance(config, HFConfigView):
            return config
        names = set(vars(config)) | set(getattr(config, "attribute_map", None) or {})
        names.add("model_type")  # a class attribute of each transformers config class
        names |= {
            name
            for klass in type(config).__mro__
            for name, value in vars(klass).items()
            if isinstance(value, property)
        }
        attributes = {}
        for name in names:
            try:
                value = getattr(config, name)
            except Exception:  # noqa: BLE001 - a property that cannot be read is left out
                continue
            if _plain(value):
                attributes[name] = value
        return cls(attributes, type(config).__name__)

    def __repr__(self) -> str:
        return f"HFConfigView({self._config_class})"

    def to_json(self) -> str:
        """The view as JSON (torch dtypes by name), for `from_json` in a later process."""
        attributes = {k: v for k, v in vars(self).items() if k != "_config_class"}
        return json.dumps(
            {"config_class": self._config_class, "attributes": attributes}, default=_dtype_name
        )

    @classmethod
    def from_json(cls, text: str) -> HFConfigView:
        """The view `to_json` wrote; reading it imports neither transformers nor torch."""
        data = json.loads(text, object_hook=_dtype_of)
        return cls(data["attributes"], data["config_class"])


def for_workers(engine_config: EngineConfig) -> EngineConfig:
    """The engine config as worker processes receive it: its Hugging Face config as a view."""
    model_config = engine_config.model_config
    if model_config is None:  # bare workers (no model)
        return engine_config
    view = HFConfigView.of(model_config.hf_config)
    return dataclasses.replace(
        engine_config, model_config=dataclasses.replace(model_config, hf_config=view)
    )


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def _dtype_name(value: Any) -> dict:
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"__torch_dtype__": str(value).removeprefix("torch.")}
    raise TypeError(f"{type(value).__name__} is not plain data")


def _dtype_of(obj: dict) -> Any:
    if set(obj) == {"__torch_dtype__"}:
        import torch

        return getattr(torch, obj["__torch_dtype__"])
    return obj
