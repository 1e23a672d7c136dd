"""OPT (facebook/opt-*): learned positions offset by 2, LayerNorm before (or after) each block,
ReLU MLP, optional project_in/project_out when the embedding is narrower than the model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmctl.engine.attention.layer import Attention
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.distributed.parallel_state import get_tp_group
from llmctl.engine.distributed.partition import PipelineShard, head_shards
from llmctl.engine.layers.activation import get_act_fn
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from llmctl.engine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.engine.models.utils import IntermediateTensors, load_weights, make_layers

_POSITION_OFFSET = 2  # OPT reserves the first two position embeddings


class OPTAttention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        hidden, heads, head_dim = shape.hidden_size, shape.num_attention_heads, shape.head_dim
        bias = shape.qkv_bias  # OPT's enable_bias
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=bias)
        shards = head_shards(heads, heads, get_tp_group().world_size)
        self.out_proj = RowParallelLinear(
            hidden, hidden, bias=bias, input_shards=[s.num_q_heads * head_dim for s in shards]
        )
        self.size = self.qkv_proj.q_size
        self.attn = Attention(
            self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.size] * 3, dim=-1)
        return self.out_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, shape: ModelShape):
        super().__init__()
        hidden, ffn_dim = shape.hidden_size, shape.intermediate_size
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        bias = shape.mlp_bias  # OPT's enable_bias
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(shape)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(
            ffn_dim, hidden, bias=bias, input_shards=self.fc1.output_shards
        )
        self.activation_fn = get_act_fn(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.shard = shard
        hidden, proj_dim = shape.hidden_size, shape.embedding_width
        if shard.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim)
            self.embed_positions = nn.Embedding(
                config.max_position_embeddings + _POSITION_OFFSET, hidden
            )
            self.project_in = (
                ReplicatedLinear(proj_dim, hidden, bias=False) if proj_dim != hidden else None
            )
        self.layers = make_layers(
            config.num_hidden_layers, shard, lambda i: OPTDecoderLayer(config, shape)
        )
        if shard.is_last:
            affine = getattr(config, "layer_norm_elementwise_affine", True)
            keep_final_norm = config.do_layer_norm_before and not getattr(
                config, "_remove_final_layer_norm", False
            )
            self.final_layer_norm = (
                nn.LayerNorm(hidden, elementwise_affine=affine) if keep_final_norm else None
            )
            self.project_out = (
                ReplicatedLinear(hidden, proj_dim, bias=False) if proj_dim != hidden else None
            )

    def forward(self, input_ids, positions, intermediate_tensors):
        if self.shard.is_first:
            embeds = self.embed_tokens(input_ids)
            if self.project_in is not None:
                embeds = self.project_in(embeds)
            hidden_states = embeds + self.embed_positions(positions + _POSITION_OFFSET)
        else:
            hidden_states = intermediate_tensors["hidden_states"]
        for layer in self.layers[self.shard.start_layer : self.shard.end_layer]:
            hidden_states = layer(hidden_states)
        if not self.shard.is_last:
            return {"hidden_states": hidden_states}
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.decoder = OPTDecoder(config, shape, shard)


class OPTForCausalLM(nn.Module):
    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    ]

    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.config = config
        self.shard = shard
        self.model = OPTModel(config, shape, shard)
        if shard.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
            if shard.is_first:
                self.lm_head.tie_weights(self.model.decoder.embed_tokens)
        self.hidden_size = config.hidden_size
        self.intermediate_keys = ("hidden_states",)  # what one pipeline stage sends the next
        self.sliding_window = None

    def forward(
        self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None
    ):
        return self.model.decoder(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        last_only = self.shard.is_last and not self.shard.is_first

        def rename(name: str) -> str | None:
            if name.startswith("decoder."):
                name = "model." + name  # facebook/opt-* checkpoints omit the "model." prefix
            if last_only and name == "model.decoder.embed_tokens.weight":
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
