"""Rule 5: a float checkpoint that no layout holds is planned on its weight-only quantization
(int8, else int4), printed with the --quantization flag that serves it."""

from __future__ import annotations

import dataclasses

from llmctl.cluster.errors import PlanError
from llmctl.cluster.inventory import Inventory
from llmctl.cluster.plan.layout_rules import choose_layout, layout_label
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.plan import Plan
from llmctl.cluster.plan.plan_options import PlanOptions
from llmctl.cluster.plan.weight_format import (
    QUANTIZATION_SCHEMES,
)
from llmctl.engine.errors import ConfigError


def replica_plan(spec: ModelSpec, inventory: Inventory, options: PlanOptions) -> Plan:
    """The layout of one engine on `inventory`. A float checkpoint too big for the inventory gets
    the layout of its weight-only quantization instead (int8, else int4), its reasons saying so
    and its serve command carrying --quantization; PlanError when even int4 does not fit."""
    try:
        return choose_layout(spec, inventory, options)
    except PlanError as too_big:
        if options.device == "cpu" or spec.prequantized:
            raise
        schemes = list(QUANTIZATION_SCHEMES)  # the largest first
        smaller = schemes[schemes.index(options.quantization) + 1 :] if options.quantization else []
        for scheme in smaller if options.quantization else schemes:
            try:
                plan = choose_layout(
                    spec, inventory, dataclasses.replace(options, quantization=scheme)
                )
            except (PlanError, ConfigError):
                continue
            if options.quantization:  # asked for: proposed, not chosen
                layout = layout_label(plan.tensor_parallel_size, plan.pipeline_parallel_size)
                hint = f"{too_big.hint}; --quantization {scheme} fits ({layout})"
                raise PlanError(too_big.message, hint) from None
            return quantized_instead(plan, too_big, spec, inventory, options)
        hint = f"{too_big.hint}; even --quantization {schemes[-1]} does not fit"
        raise PlanError(too_big.message, hint) from None


def quantized_instead(
    plan: Plan, too_big: PlanError, spec: ModelSpec, inventory: Inventory, options: PlanOptions
) -> Plan:
    """The quantized plan, its first reasons saying why it is quantized; the smaller schemes
    that fit are offered next to it."""
    scheme = QUANTIZATION_SCHEMES[plan.quantization]
    reasons = (
        f"too big in {plan.dtype}: {too_big.message}",
        f"so weight-only {scheme.name} quantization (--quantization {scheme.name}): "
        f"{_scheme_text(scheme)}; the embedding and LM head in {plan.dtype}",
    )
    alternatives = list(plan.alternatives)
    schemes = list(QUANTIZATION_SCHEMES)
    for smaller in schemes[schemes.index(scheme.name) + 1 :]:
        try:
            other = choose_layout(
                spec, inventory, dataclasses.replace(options, quantization=smaller)
            )
        except (PlanError, ConfigError):
            continue
        layout = layout_label(other.tensor_parallel_size, other.pipeline_parallel_size)
        ratio = other.kv_cache_tokens / max(plan.kv_cache_tokens, 1)
        offer = (
            f"{_scheme_text(QUANTIZATION_SCHEMES[smaller])}: {other.gpus_used} GPU(s), "
            f"{ratio:.1f}x the KV cache"
        )
        alternatives.append((f"{layout} with --quantization {smaller}", offer))
    return dataclasses.replace(
        plan, reasons=reasons + plan.reasons, alternatives=tuple(alternatives)
    )


def _scheme_text(scheme) -> str:
    """ "the linear layers in 4-bit groups of 32 with their scales, 0.75 bytes per weight"."""
    return (
        f"the linear layers in {scheme.bits}-bit groups of {scheme.group_size} with their scales, "
        f"{scheme.format.bytes_per_weight:.4g} bytes per weight"
    )
