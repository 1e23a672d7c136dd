"""Routing (engine/layers/moe_routing.py) against transformers' own routers on the same logits:
DeepSeek-V3's sigmoid scores with e_score_correction_bias over its best groups, DeepSeek-V2's
softmax group_limited_greedy, GLM-4.5's; the same experts and, bit for bit, the same weights."""

from __future__ import annotations

import pytest
import torch
from support import routed_configs, spread_routers

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.moe_routing import Routing
from llmctl.engine.models.deepseek_v2 import moe_routing


@pytest.mark.parametrize(
    "family", ["deepseek-v3", "deepseek-v3-no-q-lora", "deepseek-v2", "glm4-moe"]
)
def test_the_same_experts_and_weights_as_transformers(family):
    from transformers import AutoModelForCausalLM

    config = routed_configs()[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    spread_routers(model)
    router = model.model.layers[1].mlp.gate
    hidden = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(3))
    logits, want_weights, want_ids = router(hidden)
    bias = getattr(router, "e_score_correction_bias", None)
    routing = moe_routing(config, ModelShape.from_hf_config(config))
    weights, ids = routing.select(logits, bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    got = weights.gather(1, order.indices)
    torch.testing.assert_close(got, want_weights.gather(1, want_order.indices), rtol=0, atol=0)


def test_groups_that_do_not_divide_the_experts_are_refused():
    routing = Routing(top_k=2, renormalize=True, num_expert_group=3, topk_group=1)
    with pytest.raises(ConfigError) as err:
        routing.check(8, "FusedMoE")
    assert "8 experts in n_group=3 groups" in err.value.message
    with pytest.raises(ConfigError) as err:
        Routing(top_k=5, renormalize=True, num_expert_group=4, topk_group=1).check(8, "FusedMoE")
    assert "top-5 experts from 1 groups of 2" in err.value.message
    with pytest.raises(ConfigError):
        Routing(top_k=2, renormalize=True, scoring_func="softplus")


def test_float32_logits_cross_the_dp_gather_in_bfloat16_columns_exactly():
    """Data-parallel dispatch gathers router logits in the hidden states' columns: float32
    logits of a bfloat16 model travel as their bits (two columns each), not rounded to bfloat16,
    so a replica routes another's tokens as that replica would."""
    from llmctl.engine.layers.fused_moe import _as_columns, _from_columns

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 3
    columns = _as_columns(logits, torch.bfloat16)
    assert columns.dtype == torch.bfloat16 and columns.shape == (5, 16)
    hidden = torch.zeros(5, 7, dtype=torch.bfloat16)
    gathered = torch.cat([hidden, columns], dim=1)  # as the all-gather carries them
    assert torch.equal(_from_columns(gathered[:, 7:], torch.float32), logits)
    same = _as_columns(logits, torch.float32)  # a float32 model: the logits as they are
    assert torch.equal(_from_columns(same, torch.float32), logits)
