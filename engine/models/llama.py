"""The Llama family: Llama 2/3, Mistral, Qwen2 (QKV bias), SmolLM2 (tied embeddings), Qwen3
(per-head q/k norm: ModelShape.qk_norm), Phi-3/Phi-4 (fused qkv_proj and gate_up_proj
checkpoints, LongRoPE).

The mixtures of experts (mixtral.py, qwen_moe.py, gpt_oss.py) are this decoder with their own
`make_mlp`. Each layer's attention takes its own sliding window (ModelShape.layer_types) and, for
gpt-oss, its learned sinks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from llmctl.engine.attention.layer import Attention
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.distributed.parallel_state import get_tp_group
from llmctl.engine.distributed.partition import PipelineShard, head_shards
from llmctl.engine.layers.activation import SiluAndMul, gated_act_fn
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.fused_moe import expert_param
from llmctl.engine.layers.gated_mlp import fused_gated_mlp
from llmctl.engine.layers.layernorm import RMSNorm
from llmctl.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llmctl.engine.layers.linear_epilogue import linear_add_rms_norm, linear_rope
from llmctl.engine.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters
from llmctl.engine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.engine.models.utils import IntermediateTensors, load_weights, make_layers


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        reduce_results: bool = True,
        act: str = "silu",
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            input_shards=self.gate_up_proj.shards[0],
            reduce_results=reduce_results,
        )
        self.act_fn = SiluAndMul() if act == "silu" else gated_act_fn(act)
        self._silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._silu:  # quantized layers at prefill (AMX or int8): one kernel (None elsewhere)
            out = fused_gated_mlp(self.gate_up_proj, self.down_proj, x)
            if out is not None:
                return out
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """QKV, the optional per-head q/k norm (`norm`: Qwen3's RMSNorm, Gemma 3's), RoPE, paged
    attention with layer `layer`'s window (and sinks), O. `scale` defaults to head_dim ** -0.5."""

    def __init__(
        self,
        shape: ModelShape,
        rotary_emb: RotaryEmbedding,
        rms_norm_eps: float = 1e-6,
        layer: int = 0,
        scale: float | None = None,
        norm: Callable[[int, float], nn.Module] = RMSNorm,
    ):
        super().__init__()
        hidden, head_dim = shape.hidden_size, shape.head_dim
        num_heads, num_kv_heads = shape.num_attention_heads, shape.num_kv_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, bias=shape.qkv_bias
        )
        shards = head_shards(num_heads, num_kv_heads, get_tp_group().world_size)
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            hidden,
            bias=shape.o_bias,
            input_shards=[s.num_q_heads * head_dim for s in shards],
        )
        self.rotary_emb = rotary_emb
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5 if scale is None else scale,
            self.qkv_proj.num_kv_heads,
            sliding_window=shape.layer_sliding_window(layer),
            sinks=shape.attention_sinks,
        )
        if self.attn.sinks is not None:  # gpt-oss: this rank's heads' sinks
            self.attn.sinks.weight_loader = self._load_sinks
        self.head_dim = head_dim
        if shape.qk_norm:  # Qwen3: each head's query and key normalized before RoPE
            self.q_norm = norm(head_dim, rms_norm_eps)
            self.k_norm = norm(head_dim, rms_norm_eps)
        self.qk_norm = shape.qk_norm

    def _load_sinks(self, param: nn.Parameter, loaded: CheckpointTensor, *args) -> None:
        shard = self.qkv_proj.shard
        rows = loaded.narrow(0, shard.q_start, shard.num_q_heads)
        param.data.copy_(rows if isinstance(rows, torch.Tensor) else rows.load())

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, hidden_states))

    def attend(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The attention's output before O."""
        num_tokens = hidden_states.shape[0]
        rotated = None
        if not self.qk_norm:  # quantized QKV at prefill (AMX or int8): RoPE in the GEMM's pass
            rotated = linear_rope(
                self.qkv_proj, self.rotary_emb, positions, hidden_states, self.q_size + self.kv_size
            )
        qkv = self.qkv_proj(hidden_states) if rotated is None else rotated
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)
        k = k.reshape(num_tokens, -1, self.head_dim)
        if rotated is None:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        # q, k, v stay views into qkv: the attention backends read any row stride
        return self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        rotary_emb: RotaryEmbedding,
        mlp: nn.Module,
        layer: int = 0,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(shape, rotary_emb, config.rms_norm_eps, layer)
        self.mlp = mlp  # LlamaMLP, or a mixture of experts
        self.input_layernorm = RMSNorm(shape.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attn = self.self_attn
        out = attn.attend(positions, hidden_states)
        # quantized O at prefill (AMX or int8): the residual add and the norm in the GEMM's pass
        normed = linear_add_rms_norm(attn.o_proj, self.post_attention_layernorm, out, residual)
        if normed is None:
            normed = self.post_attention_layernorm(attn.o_proj(out), residual)
        hidden_states, residual = normed
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        shard: PipelineShard,
        make_mlp: Callable[[int], nn.Module],
    ):
        super().__init__()
        self.shard = shard
        if shard.is_first:
            self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size)
        # One rotary table for all layers (not a submodule of each: its buffers are not weights).
        length = shape.max_position_embeddings
        rotary_emb = get_rope(shape.head_dim, length, rope_parameters(config))
        self.layers = make_layers(
            shape.num_layers,
            shard,
            lambda i: LlamaDecoderLayer(config, shape, rotary_emb, make_mlp(i), i),
        )
        if shard.is_last:
            self.norm = RMSNorm(shape.hidden_size, config.rms_norm_eps)

    def stage_layers(self) -> list[nn.Module]:
        """This pipeline stage's layers (a plain list, made once: slicing the ModuleList builds
        a new one every step)."""
        layers = self.__dict__.get("_stage_layers")
        if layers is None:
            layers = list(self.layers[self.shard.start_layer : self.shard.end_layer])
            self.__dict__["_stage_layers"] = layers
        return layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.shard.is_first:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.stage_layers():
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.shard.is_last:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # (fused parameter, checkpoint part, shard id)
    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # Checkpoint module names -> ours (Mixtral's `block_sparse_moe` is our `mlp`).
    renamed_modules: dict[str, str] = {}

    def __init__(self, config: Any, shape: ModelShape, shard: PipelineShard):
        super().__init__()
        self.config = config
        self.shard = shard
        # Sizes and biases (Qwen2's QKV bias, attention_bias, mlp_bias) from the model's shape.
        self.shape = shape
        self.model = LlamaModel(config, shape, shard, self.make_mlp)
        if shard.is_last:
            self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size)
            if shape.tie_word_embeddings:
                if shard.is_first:
                    self.lm_head.tie_weights(self.model.embed_tokens)
        self.hidden_size = shape.hidden_size
        self.intermediate_keys = (
            "hidden_states",
            "residual",
        )  # what one pipeline stage sends the next

    def make_mlp(self, layer: int) -> nn.Module:
        """Decoder layer `layer`'s MLP (mixture-of-experts models return their MoE block)."""
        shape = self.shape
        return LlamaMLP(shape.hidden_size, shape.intermediate_size, shape.mlp_bias)

    @property
    def reads_tied_embedding(self) -> bool:
        """The last stage loads the LM head from the embedding tensor (tied, other stage)."""
        return self.shape.tie_word_embeddings and not self.shard.is_first

    def forward(self, input_ids, positions, intermediate_tensors=None):
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        tied = self.reads_tied_embedding

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if tied and name == "model.embed_tokens.weight":
                return "lm_head.weight"
            for theirs, ours in self.renamed_modules.items():
                name = name.replace(f".{theirs}.", f".{ours}.")
            return name

        return load_weights(
            self,
            weights,
            stacked=self.stacked_params,
            rename=rename,
            shard=self.shard,
            layer_marker="layers",
            experts=expert_param if self.shape.num_experts else None,
        )


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass  # its QKV bias: ModelShape.qkv_bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass  # its q/k norm: ModelShape.qk_norm


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4: the checkpoint's qkv_proj ([q | k | v] rows) and gate_up_proj
    ([gate | up] rows) are each one tensor, which the fused layers' weight loaders split into
    this rank's heads and features. LongRoPE comes with the rope parameters."""

    stacked_params = [
        *LlamaForCausalLM.stacked_params,
        ("qkv_proj", "qkv_proj", "qkv"),
        ("gate_up_proj", "gate_up_proj", "fused"),
    ]
