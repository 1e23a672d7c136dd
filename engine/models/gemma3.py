"""Gemma 3 (text): Gemma3ForCausalLM.

The Llama decoder's parts, with Gemma's own:
- RMSNorm scales by (1 + weight), computed in float32 and rounded once (GemmaRMSNorm); four per
  layer: before and after attention, before and after the MLP, each sub-block's output
  normalized before it joins the residual stream.
- The embedding is scaled by sqrt(hidden_size) (in the model's dtype, as transformers rounds it).
- Each head's query and key are normalized (Gemma's RMSNorm) before RoPE; scores are scaled by
  query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- Layers alternate sliding-window and global attention (five to one in the released models,
  ModelShape.layer_types), each kind with its own RoPE: base 10,000 on sliding layers, the
  config's (1,000,000, with linear scaling on the larger models) on global ones.
- The MLP is GELU-tanh gated; the LM head is tied to the embedding; an optional final logit
  softcap (tanh) applies to the logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmctl.engine.config.model_shape import FULL_ATTENTION, SLIDING_ATTENTION, ModelShape
from llmctl.engine.distributed.partition import PipelineShard
from llmctl.engine.errors import UnsupportedArchitectureError
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.rotary_embedding import get_rope, rope_parameters
from llmctl.engine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from llmctl.engine.models.utils import IntermediateTensors, load_weights, make_layers


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back once (the weight stored as Gemma's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, rotary_emb: nn.Module, layer: int):
        super().__init__()
        eps, h = config.rms_norm_eps, shape.hidden_size
        scalar = getattr(config, "query_pre_attn_scalar", None) or shape.head_dim
        self.self_attn = LlamaAttention(
            shape, rotary_emb, eps, layer, scale=float(scalar) ** -0.5, norm=GemmaRMSNorm
        )
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.mlp = LlamaMLP(h, shape.intermediate_size, bias=False, act=act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.shard = shard
        h = shape.hidden_size
        if shard.is_first:
            self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, h)
            # sqrt(hidden) rounded to the model's dtype, as transformers scales it
            normalizer = torch.tensor(h**0.5, dtype=torch.float32).to(torch.get_default_dtype())
            self.register_buffer("normalizer", normalizer, persistent=False)
        # One rotary table per attention kind (not submodules of the layers: not weights).
        length = shape.max_position_embeddings
        ropes = {
            kind: get_rope(shape.head_dim, length, rope_parameters(config, kind))
            for kind in (SLIDING_ATTENTION, FULL_ATTENTION)
        }
        self.layers = make_layers(
            shape.num_layers,
            shard,
            lambda i: Gemma3DecoderLayer(config, shape, ropes[_kind(shape, i)], i),
        )
        if shard.is_last:
            self.norm = GemmaRMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.shard.is_first:
            hidden_states = self.embed_tokens(input_ids) * self.normalizer
        else:
            hidden_states = intermediate_tensors["hidden_states"]
        for layer in self.layers[self.shard.start_layer : self.shard.end_layer]:
            hidden_states = layer(positions, hidden_states)
        if not self.shard.is_last:
            return {"hidden_states": hidden_states}
        return self.norm(hidden_states)


def _kind(shape: ModelShape, layer: int) -> str:
    return SLIDING_ATTENTION if shape.layer_sliding_window(layer) else FULL_ATTENTION


class Gemma3ForCausalLM(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None):
            raise UnsupportedArchitectureError(
                "attention logit softcapping (attn_logit_softcapping) is not supported",
                "Gemma 3 checkpoints leave it unset; serve one without it",
            )
        self.config = config
        self.shard = shard
        self.shape = shape
        self.model = Gemma3Model(config, shape, shard)
        if shard.is_last:
            self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size)
            if shape.tie_word_embeddings and shard.is_first:
                self.lm_head.tie_weights(self.model.embed_tokens)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.hidden_size = shape.hidden_size
        self.intermediate_keys = ("hidden_states",)  # what one pipeline stage sends the next

    @property
    def reads_tied_embedding(self) -> bool:
        return self.shape.tie_word_embeddings and not self.shard.is_first

    def forward(self, input_ids, positions, intermediate_tensors=None):
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden_states)
        if logits is not None and self.softcap:  # in float32, as the sampler computes
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        tied = self.reads_tied_embedding

        def rename(name: str) -> str | None:
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
        )
