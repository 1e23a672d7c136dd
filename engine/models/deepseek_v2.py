"""DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2, a DeepseekV3ForCausalLM): multi-head latent
attention and a mixture of experts with shared experts, the first `first_k_dense_replace` layers
dense.

Attention (engine/config/mla_shape.py has the shapes): queries from q_proj, or q_a_proj, its
RMSNorm and q_b_proj (q_lora_rank); the latent and the shared rope key from the replicated
kv_a_proj_with_mqa, the latent normalized by kv_a_layernorm; rotary embeddings on the rope parts
(interleaved pairs, as both models are trained; V3 may say rope_interleave: false), YaRN with its
mscale: the softmax scale is qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2. MLAAttention
(attention/mla_layer.py) holds the paged latent cache and attends through kv_b_proj.

MoE (DeepseekMoE, also GLM-4.5's): the router's logits in float32 from its replicated weight;
DeepSeek-V2 scores by softmax (greedy, or group_limited_greedy over n_group groups), V3 by
sigmoid plus e_score_correction_bias over its best topk_group groups (layers/moe_routing.py);
the chosen weights renormalized when norm_topk_prob, times routed_scaling_factor. The routed
experts (FusedMoE) and the shared experts (one SiLU-gated MLP of n_shared_experts x
moe_intermediate_size features, no gate) are partial sums on each rank, added before one
all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.attention.mla_layer import MLAAttention
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.distributed.parallel_state import get_tp_group
from llmctl.engine.distributed.partition import PipelineShard, head_shards
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.fused_moe import FusedMoE, expert_param
from llmctl.engine.layers.layernorm import RMSNorm
from llmctl.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from llmctl.engine.layers.moe_routing import Routing
from llmctl.engine.layers.quantization.linear_method import set_quant_config
from llmctl.engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters, yarn_mscale
from llmctl.engine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.engine.models.llama import LlamaMLP
from llmctl.engine.models.utils import load_weights, make_layers


class MoEGate(nn.Module):
    """The router: logits [num_tokens, num_experts] in float32 (as transformers computes them),
    and V3's e_score_correction_bias, kept in float32."""

    def __init__(self, hidden_size: int, num_experts: int, score_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = None
        if score_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight.float())


def moe_routing(config: Any, shape: ModelShape) -> Routing:
    """The Routing of a DeepSeek-V2/V3 or GLM-4.5 config (see the module docstring)."""
    sigmoid = shape.expert_score_bias or getattr(config, "scoring_func", None) == "sigmoid"
    grouped = sigmoid or getattr(config, "topk_method", "greedy") == "group_limited_greedy"
    return Routing(
        top_k=shape.num_experts_per_tok,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        num_expert_group=getattr(config, "n_group", None) if grouped else None,
        topk_group=getattr(config, "topk_group", None) if grouped else None,
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
    )


class DeepseekMoE(nn.Module):
    def __init__(self, config: Any, shape: ModelShape):
        super().__init__()
        hidden = shape.hidden_size
        self.gate = MoEGate(hidden, shape.num_experts, shape.expert_score_bias)
        self.experts = FusedMoE(
            num_experts=shape.num_experts,
            top_k=shape.num_experts_per_tok,
            hidden_size=hidden,
            intermediate_size=shape.expert_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            reduce_results=False,
            routing=moe_routing(config, shape),
            e_score_correction_bias=self.gate.e_score_correction_bias,
        )
        self.shared_experts = None
        if shape.shared_expert_intermediate_size:
            self.shared_experts = LlamaMLP(
                hidden, shape.shared_expert_intermediate_size, bias=False, reduce_results=False
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_tokens, hidden_size], a partial sum on each rank until the all-reduce
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return get_tp_group().all_reduce(out)


def mla_softmax_scale(config: Any, shape: ModelShape) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = shape.head_dim**-0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(float(params["factor"]), float(mscale_all_dim)) ** 2
    return scale


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, rotary_emb: RotaryEmbedding):
        super().__init__()
        h, heads = shape.hidden_size, shape.num_attention_heads
        nope, rope, v = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim
        tp = get_tp_group()
        local = [s.num_q_heads for s in head_shards(heads, heads, tp.world_size)]
        self.num_heads = local[tp.rank_in_group]
        self.qk_head_dim, self.kv_lora_rank, self.rope = nope + rope, shape.kv_lora_rank, rope
        self.q_lora_rank = shape.q_lora_rank
        eps = config.rms_norm_eps
        qk_rows = [n * (nope + rope) for n in local]
        if shape.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, shape.q_lora_rank, bias=shape.qkv_bias)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(
                shape.q_lora_rank, heads * (nope + rope), bias=False, output_shards=qk_rows
            )
        else:
            self.q_proj = ColumnParallelLinear(h, heads * (nope + rope), False, qk_rows)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, shape.kv_lora_rank + rope, shape.qkv_bias)
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, eps)
        with set_quant_config(None):  # float, unpacked: its rows are the absorbed weights
            self.kv_b_proj = ColumnParallelLinear(
                shape.kv_lora_rank,
                heads * (nope + v),
                bias=False,
                output_shards=[n * (nope + v) for n in local],
            )
        self.kv_b_proj.cpu_prepack = False
        self.o_proj = RowParallelLinear(
            heads * v, h, bias=shape.o_bias, input_shards=[n * v for n in local]
        )
        self.rotary_emb = rotary_emb
        scale = mla_softmax_scale(config, shape)
        self.attn = MLAAttention(
            self.num_heads, nope, rope, v, shape.kv_lora_rank, scale, self.kv_b_proj
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_head_dim - self.rope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.rope], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        out = self.attn(torch.cat((q_nope, q_pe), dim=-1), latent, k_pe.squeeze(1))
        return self.o_proj(out)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = DeepseekV2MLAAttention(config, shape, rotary_emb)
        if shape.is_moe_layer(layer):
            self.mlp = DeepseekMoE(config, shape)
        else:
            self.mlp = LlamaMLP(shape.hidden_size, shape.intermediate_size, shape.mlp_bias)
        self.input_layernorm = RMSNorm(shape.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.shard = shard
        if shard.is_first:
            self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size)
        # One rotary table for all layers, over the rope dims (DeepSeek-V2 always interleaves).
        interleaved = bool(getattr(config, "rope_interleave", True))
        rotary_emb = RotaryEmbedding(
            shape.qk_rope_head_dim,
            shape.max_position_embeddings,
            rope_parameters(config),
            interleaved=interleaved or config.model_type == "deepseek_v2",
        )
        self.layers = make_layers(
            shape.num_layers, shard, lambda i: DeepseekV2DecoderLayer(config, shape, rotary_emb, i)
        )
        if shard.is_last:
            self.norm = RMSNorm(shape.hidden_size, config.rms_norm_eps)

    def _stage_layers(self) -> list[nn.Module]:
        """This stage's layers, listed once (slicing the ModuleList builds one every step)."""
        layers = self.__dict__.get("_layers_here")
        if layers is None:
            layers = self.__dict__["_layers_here"] = list(
                self.layers[self.shard.start_layer : self.shard.end_layer]
            )
        return layers

    def forward(self, input_ids, positions, intermediate_tensors):
        if self.shard.is_first:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self._stage_layers():
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.shard.is_last:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DeepseekV2ForCausalLM(nn.Module):
    # (fused parameter, checkpoint part, shard id): the dense and shared experts' MLPs
    stacked_params = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.config, self.shape, self.shard = config, shape, shard
        self.model = DeepseekV2Model(config, shape, shard)
        if shard.is_last:
            self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size)
            if shape.tie_word_embeddings and shard.is_first:
                self.lm_head.tie_weights(self.model.embed_tokens)
        self.hidden_size = shape.hidden_size
        self.intermediate_keys = ("hidden_states", "residual")  # what a stage sends the next

    def forward(self, input_ids, positions, intermediate_tensors=None):
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        tied = self.shape.tie_word_embeddings and not self.shard.is_first

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if tied and name == "model.embed_tokens.weight":
                return "lm_head.weight"
            return name

        return load_weights(
            self,
            weights,
            stacked=self.stacked_params,
            rename=rename,
            shard=self.shard,
            layer_marker="layers",
            experts=expert_param,
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass  # its sigmoid routing with e_score_correction_bias: ModelShape.expert_score_bias
