"""Qwen2-MoE and Qwen3-MoE: the Llama decoder (Qwen2's QKV bias; Qwen3's per-head q/k norm) with
a mixture of experts as the MLP of every `decoder_sparse_step`-th layer not in `mlp_only_layers`.

Routing is softmax then top-k, renormalized when the config's `norm_topk_prob` says so (False by
default). Qwen2-MoE adds a shared expert to every token, scaled by sigmoid(shared_expert_gate(x)).
The routed and shared outputs are partial sums on each rank (expert or feature slices), added
before the one all-reduce: the gate's scalar comes from the replicated input, so scaling each
rank's partial shared output scales their sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.distributed.parallel_state import get_tp_group
from llmctl.engine.layers.fused_moe import FusedMoE
from llmctl.engine.layers.linear import ReplicatedLinear
from llmctl.engine.layers.quantization.linear_method import router_quant_config
from llmctl.engine.models.llama import LlamaForCausalLM, LlamaMLP


class QwenMoeSparseMoeBlock(nn.Module):
    def __init__(self, config: Any, shape: ModelShape):
        super().__init__()
        hidden = shape.hidden_size
        with router_quant_config():
            self.gate = ReplicatedLinear(hidden, shape.num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=shape.num_experts,
            top_k=shape.num_experts_per_tok,
            hidden_size=hidden,
            intermediate_size=shape.expert_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            reduce_results=False,
        )
        self.shared_expert = None
        if shape.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(
                hidden, shape.shared_expert_intermediate_size, bias=False, reduce_results=False
            )
            with router_quant_config():
                self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_tokens, hidden_size], a partial sum on each rank until the all-reduce
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
            out = out + gate * self.shared_expert(hidden_states)
        return get_tp_group().all_reduce(out)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module:
        shape = self.shape
        if shape.is_moe_layer(layer):
            return QwenMoeSparseMoeBlock(self.config, shape)
        return LlamaMLP(shape.hidden_size, shape.intermediate_size, bias=False)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    pass  # its q/k norm: ModelShape.qk_norm; no shared expert
