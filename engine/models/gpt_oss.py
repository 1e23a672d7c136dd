"""gpt-oss: GptOssForCausalLM.

The Llama decoder with biases on q, k, v and o, a learned sink per attention head (a logit that
joins every softmax's denominator: attention/layer.py), sliding-window (128) and full attention
alternating (ModelShape.layer_types), YaRN RoPE, and a mixture of experts as every MLP:

- the router has a bias; each token takes its top-k logits and a softmax over those k;
- each expert is a clamped SwiGLU with biases: gate_up = x W_gu + b_gu with gate and up
  interleaved in its columns (gate 2j, up 2j + 1), gate clamped above at `limit`, up to
  [-limit, limit], glu = gate * sigmoid(alpha gate), out = ((up + 1) glu) W_down + b_down.

OpenAI's published checkpoints hold the experts in MXFP4 (`*_blocks`: two e2m1 values a byte,
the low nibble first, 32 to a group; `*_scales`: one e8m0 exponent per group, bias 127); they are
dequantized as they are read, exactly (every value is representable in bfloat16), and run in the
model's dtype.

The experts are held in the checkpoint's own layout, as transformers multiplies them:
gate_up_proj [E, H, 2I], down_proj [E, I, H]. Under tensor parallelism a rank holds features
[s, s + I_r) of every expert: gate_up columns [2s, 2s + 2I_r), a contiguous run thanks to the
interleaving, and down rows [s, s + I_r); the down bias is added on rank 0 only, so the
all-reduce adds it once. Under expert parallelism a rank holds whole experts (FusedMoE).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import UnsupportedArchitectureError
from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor
from llmctl.engine.layers.fused_moe import FusedMoE, dispatch_experts
from llmctl.engine.layers.linear import ReplicatedLinear, _copy_into
from llmctl.engine.layers.quantization.linear_method import (
    current_quant_config,
    router_quant_config,
)
from llmctl.engine.models.llama import LlamaForCausalLM
from llmctl.engine.models.utils import layer_index

# e2m1: the 16 values of a 4-bit MXFP4 code (sign bit highest)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_VALUES += tuple(-v for v in _FP4_VALUES)
_MXFP4_PARTS = ("_blocks", "_scales")


class GptOssExperts(FusedMoE):
    """gpt-oss's routed experts: FusedMoE's placement and dispatch, its own weights and MLP."""

    def __init__(self, shape: ModelShape, alpha: float, limit: float):
        if current_quant_config() is not None:
            raise UnsupportedArchitectureError(
                "gpt-oss experts cannot be quantized by llmctl",
                "serve gpt-oss without --quantization (its experts run in the model's dtype)",
            )
        self.alpha, self.limit = alpha, limit
        super().__init__(
            shape.num_experts,
            shape.num_experts_per_tok,
            shape.hidden_size,
            shape.expert_intermediate_size,
            renormalize=True,
        )

    def _create_weights(self, hidden_size: int) -> None:
        n, inter = self.num_local_experts, self.intermediate_size_per_partition
        self.quant_method = None
        self._packed = None
        shapes = {
            "gate_up_proj": (n, hidden_size, 2 * inter),
            "gate_up_proj_bias": (n, 2 * inter),
            "down_proj": (n, inter, hidden_size),
            "down_proj_bias": (n, hidden_size),
        }
        for name, size in shapes.items():
            param = nn.Parameter(torch.empty(size), requires_grad=False)
            param.weight_loader = self._loader(name)
            self.register_parameter(name, param)

    def _loader(self, name: str):
        def load(param: nn.Parameter, loaded: CheckpointTensor, *args) -> None:
            rows = loaded.narrow(0, self.first_expert, self.num_local_experts)
            rows = rows if isinstance(rows, torch.Tensor) else rows.load()
            start, size = self.intermediate_start, self.intermediate_size_per_partition
            if name.startswith("gate_up"):  # interleaved columns 2s .. 2s + 2I_r
                rows = rows.narrow(rows.dim() - 1, 2 * start, 2 * size)
            elif name == "down_proj":
                rows = rows.narrow(1, start, size)
            elif not self.expert_parallel and self.group.rank_in_group:
                rows = torch.zeros_like(rows)  # tensor parallel: rank 0 adds the down bias
            _copy_into(param.data, rows, f"{name} of experts {self.first_expert}..")

        return load

    def process_weights_after_loading(self) -> None:
        pass  # kept in the checkpoint's layout, multiplied as transformers does

    def _experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(router_logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        limit, alpha = self.limit, self.alpha

        def mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            gate = gate_up[..., ::2].clamp(min=None, max=limit)
            up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            return ((up + 1) * glu) @ self.down_proj[expert] + self.down_proj_bias[expert]

        return dispatch_experts(
            hidden_states, self.num_local_experts, mlp, weights, ids, self.first_expert
        )


class GptOssMoE(nn.Module):
    """Router (replicated, with a bias) and experts; one all-reduce."""

    def __init__(self, config, shape: ModelShape):
        super().__init__()
        with router_quant_config():
            self.router = ReplicatedLinear(shape.hidden_size, shape.num_experts, bias=True)
        alpha = float(getattr(config, "swiglu_alpha", 1.702))
        limit = float(getattr(config, "swiglu_limit", 7.0))
        self.experts = GptOssExperts(shape, alpha, limit)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoE(self.config, self.shape)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        # The sinks are the attention layer's own weight.
        renamed = (
            (name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor)
            for name, tensor in self._dequantized(weights)
        )
        return super().load_weights(renamed)

    def _dequantized(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors, an MXFP4 expert tensor's blocks and scales (in either
        order) as one float tensor in transformers' layout; other stages' layers unread."""
        pending: dict[str, dict[str, CheckpointTensor]] = {}
        for name, tensor in weights:
            part = next((p for p in _MXFP4_PARTS if name.endswith(p)), None)
            if part is None:
                yield name, tensor
                continue
            base = name.removesuffix(part)
            index = layer_index(base, "layers")
            if index is not None and not self.shard.start_layer <= index < self.shard.end_layer:
                continue
            parts = pending.setdefault(base, {})
            parts[part] = tensor
            if len(parts) == len(_MXFP4_PARTS):
                del pending[base]
                blocks, scales = parts["_blocks"].load(), parts["_scales"].load()
                yield base, CheckpointTensor.from_tensor(base, dequantize_mxfp4(blocks, scales))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, rows, G, 16] uint8, scales [E, rows, G] uint8 -> [E, G * 32, rows] float32:
    each byte's low nibble then its high one, times 2 ** (scale - 127); transposed to the layout
    transformers multiplies by (gate_up_proj [E, H, 2I], down_proj [E, I, H])."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127)[..., None]
    return values.flatten(-2).transpose(1, 2).contiguous()
