"""PlanOptions: what `llmctl plan` plans for, derived from EngineArgs rather than copied from it.

Its fields are every EngineArgs field whose OptionSpec lists PLAN (the options a prediction
depends on: dtype, max_model_len, block_size, gpu_memory_utilization, the layout, quantization,
...), with the engine's type and default, then the planner's own: `min_concurrency` and
`allow_uneven_tp`. Where the engine's default is a choice the planner makes, the planner's
default is None ("choose"): tensor_parallel_size, pipeline_parallel_size, data_parallel_size;
and `device` is "cuda" (the inventory's GPUs) where the engine says "auto". A new PLAN option of
EngineArgs is a new field here with nothing to edit.

Validation is EngineArgs' own: a PlanOptions builds the EngineArgs it stands for, so `plan` and
`serve` refuse the same values with the same words. The KV cache is held in the model's dtype,
as the engine holds it (no fp8 KV cache: the engine has none, so the plan does not promise one).
"""

from __future__ import annotations

import dataclasses
import typing

from llmctl.cluster.plan.weight_format import quantization_format
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.options import PLAN, cli_options
from llmctl.engine.errors import ConfigError

# EngineArgs options whose planner default differs: None = the planner chooses.
_PLANNER_DEFAULTS = {
    "tensor_parallel_size": None,
    "pipeline_parallel_size": None,
    "data_parallel_size": None,
    "device": "cuda",
}
ENGINE_FIELDS = tuple(o.name for o in cli_options(PLAN, EngineArgs))


def _fields() -> list[tuple[str, object, dataclasses.Field]]:
    hints = typing.get_type_hints(EngineArgs)
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    fields = []
    for name in ENGINE_FIELDS:
        if name in _PLANNER_DEFAULTS:
            default = _PLANNER_DEFAULTS[name]
            hint = hints[name] if default is not None else hints[name] | None
        else:
            default, hint = engine_fields[name].default, hints[name]
        fields.append((name, hint, dataclasses.field(default=default)))
    # The planner's own: requests of max_model_len that must fit at once, and whether a TP
    # size that does not divide the heads (llmctl runs it, vLLM cannot) may be chosen.
    fields.append(("min_concurrency", int, dataclasses.field(default=1)))
    fields.append(("allow_uneven_tp", bool, dataclasses.field(default=False)))
    return fields


def _check(self) -> None:
    if self.device not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device {self.device!r}", "use cuda or cpu")
    if self.data_parallel_size is not None and self.data_parallel_size < 1:
        raise ConfigError(  # an asked count of replicas (None: the planner chooses)
            f"data_parallel_size must be at least 1, got {self.data_parallel_size}",
            "pass --data-parallel-size 1 or more, or leave it out to let the plan choose",
        )
    engine = {name: getattr(self, name) for name in ENGINE_FIELDS}
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if engine[name] is None:  # the planner chooses: check the rest with the engine's own
            del engine[name]
    EngineArgs(**engine)  # the engine's checks, its words
    if self.quantization is not None:
        quantization_format(self.quantization)
    if self.min_concurrency < 1:
        raise ConfigError(
            f"min_concurrency must be at least 1, got {self.min_concurrency}",
            "ask for at least one request",
        )


PlanOptions = dataclasses.make_dataclass(
    "PlanOptions",
    _fields(),
    frozen=True,
    namespace={"__post_init__": _check, "__doc__": __doc__.split("\n\n")[0]},
)
PlanOptions.__module__ = __name__
