"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, fused c_attn, tied LM head.

Hugging Face stores GPT-2's projections as Conv1D weights of shape [in, out]; the loader reads
them transposed, so the Megatron layers see [out, in] like every other model.
"""

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
from llmctl.engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmctl.engine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.engine.models.utils import IntermediateTensors, load_weights, make_layers

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, layer_idx: int):
        super().__init__()
        hidden, heads, head_dim = shape.hidden_size, shape.num_attention_heads, shape.head_dim
        self.c_attn = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        shards = head_shards(heads, heads, get_tp_group().world_size)
        self.c_proj = RowParallelLinear(
            hidden, hidden, bias=True, input_shards=[s.num_q_heads * head_dim for s in shards]
        )
        scale = head_dim**-0.5
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.size = self.c_attn.q_size
        self.attn = Attention(self.c_attn.num_heads, head_dim, scale, self.c_attn.num_kv_heads)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).split([self.size] * 3, dim=-1)
        return self.c_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, shape: ModelShape):
        super().__init__()
        inner = shape.intermediate_size
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, bias=True)
        self.c_proj = RowParallelLinear(
            inner, config.n_embd, bias=True, input_shards=self.c_fc.output_shards
        )
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, layer_idx: int):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=eps)
        self.attn = GPT2Attention(config, shape, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=eps)
        self.mlp = GPT2MLP(config, shape)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.shard = shard
        if shard.is_first:
            self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = make_layers(config.n_layer, shard, lambda i: GPT2Block(config, shape, i))
        if shard.is_last:
            self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, intermediate_tensors):
        if self.shard.is_first:
            hidden_states = self.wte(input_ids) + self.wpe(positions)
        else:
            hidden_states = intermediate_tensors["hidden_states"]
        for block in self.h[self.shard.start_layer : self.shard.end_layer]:
            hidden_states = block(hidden_states)
        if not self.shard.is_last:
            return {"hidden_states": hidden_states}
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    stacked_params = [("c_attn", "c_attn", "qkv")]

    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.config = config
        self.shard = shard
        self.transformer = GPT2Model(config, shape, shard)
        if shard.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.n_embd)
            if shard.is_first:
                self.lm_head.tie_weights(self.transformer.wte)
        self.hidden_size = config.n_embd
        self.intermediate_keys = ("hidden_states",)  # what one pipeline stage sends the next
        self.sliding_window = None

    def forward(
        self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None
    ):
        return self.transformer(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        last_only = self.shard.is_last and not self.shard.is_first

        def rename(name: str) -> str | None:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                return None  # causal-mask buffers of old checkpoints
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            if last_only and name == "transformer.wte.weight":
                return "lm_head.weight"  # tied LM head on a stage without the embedding
            return name

        return load_weights(
            self,
            weights,
            stacked=self.stacked_params,
            rename=rename,
            shard=self.shard,
            layer_marker="h",
            transpose=lambda name: name.endswith(_CONV1D),
        )
