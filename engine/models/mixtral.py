"""Mixtral: the Llama decoder with a mixture of experts (top-k, renormalized) for its MLP."""

from __future__ import annotations

import torch
from torch import nn

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.layers.fused_moe import FusedMoE
from llmctl.engine.layers.linear import ReplicatedLinear
from llmctl.engine.layers.quantization.linear_method import router_quant_config
from llmctl.engine.models.llama import LlamaForCausalLM


class MixtralSparseMoeBlock(nn.Module):
    """Router (replicated) and routed experts (FusedMoE, one all-reduce)."""

    def __init__(self, shape: ModelShape, renormalize: bool = True):
        super().__init__()
        with router_quant_config():
            self.gate = ReplicatedLinear(shape.hidden_size, shape.num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=shape.num_experts,
            top_k=shape.num_experts_per_tok,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.expert_intermediate_size,
            renormalize=renormalize,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralForCausalLM(LlamaForCausalLM):
    renamed_modules = {"block_sparse_moe": "mlp"}

    def make_mlp(self, layer: int) -> nn.Module:
        return MixtralSparseMoeBlock(self.shape)
