"""GLM-4.5 (Glm4MoeForCausalLM): the Llama decoder with QKV bias, a per-head q/k RMSNorm
(`use_qk_norm`) and rotary embeddings on the first partial_rotary_factor of each head (the rest
passes through), its MLP a mixture of experts routed as DeepSeek-V3's (sigmoid scores with
e_score_correction_bias, n_group / topk_group, routed_scaling_factor) plus shared experts, the
first `first_k_dense_replace` layers dense (DeepseekMoE, models/deepseek_v2.py)."""

from __future__ import annotations

from torch import nn

from llmctl.engine.models.deepseek_v2 import DeepseekMoE
from llmctl.engine.models.llama import LlamaForCausalLM, LlamaMLP


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module:
        shape = self.shape
        if shape.is_moe_layer(layer):
            return DeepseekMoE(self.config, shape)
        return LlamaMLP(shape.hidden_size, shape.intermediate_size, bias=False)
