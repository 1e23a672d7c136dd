"""Mixture-of-experts GGUF files: llama.cpp's stacked expert tensors under Hugging Face names.

llama.cpp writes Mixtral as architecture `llama` with `llama.expert_count` set, and Qwen2-MoE /
Qwen3-MoE as `qwen2moe` / `qwen3moe`. Per layer N it stores (PyTorch order):

    blk.N.ffn_gate_inp.weight        [E, H]       the router
    blk.N.ffn_gate_exps.weight       [E, I, H]    every expert's gate, stacked
    blk.N.ffn_up_exps.weight         [E, I, H]    ... up
    blk.N.ffn_down_exps.weight       [E, H, I]    ... down
    blk.N.ffn_gate_inp_shexp.weight  [H]          Qwen2-MoE's shared expert gate (HF: [1, H])
    blk.N.ffn_{gate,up,down}_shexp.weight         Qwen2-MoE's shared expert MLP

The stacked tensors are yielded as one CheckpointTensor (or quantized one) per expert, under the
per-expert names Hugging Face checkpoints use (`...experts.3.w1.weight`), so FusedMoE's weight
loader takes them as it takes a safetensors checkpoint's. The config keys a MoE model needs
beyond ModelShape's sizes come from `moe_config_values`. llama.cpp routes as the HF models do:
Mixtral and Qwen3-MoE renormalize the top-k weights, Qwen2-MoE does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import UnsupportedArchitectureError

# GGUF architectures with experts -> (transformers model_type, architecture, MLP module, names of
# an expert's gate / up / down)
_MOE = {
    "llama": ("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
}
_STACKED = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_SHARED = {
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
EXPERT = "{expert}"  # where a stacked tensor's name takes each expert's index


def moe_hf_name(arch: str, layer: str, part: str, kind: str) -> str | None:
    """Hugging Face name of GGUF tensor blk.<layer>.<part>.<kind> of a MoE architecture; a
    stacked expert tensor's name holds EXPERT. None: not a MoE tensor."""
    if arch not in _MOE:
        return None
    _, _, mlp, roles = _MOE[arch]
    prefix = f"model.layers.{layer}"
    if part == "ffn_gate_inp":
        return f"{prefix}.{mlp}.gate.{kind}"
    if part in _STACKED:
        return f"{prefix}.{mlp}.experts.{EXPERT}.{roles[_STACKED[part]]}.{kind}"
    if arch == "qwen2moe" and part in _SHARED:
        return f"{prefix}.mlp.{_SHARED[part]}.{kind}"
    if arch == "qwen3moe" and part in _QK_NORM:
        return f"{prefix}.{_QK_NORM[part]}.{kind}"
    return None


def check_moe_tensors(gguf_path, arch: str, shape: ModelShape, tensor_names: tuple[str, ...]):
    """Refuse a MoE file llmctl cannot read: another architecture with experts, or llama.cpp's
    old Mixtral layout of one tensor per expert (blk.N.ffn_gate.E.weight)."""
    what = f"{gguf_path} holds a mixture-of-experts model ({shape.num_experts} experts)"
    if arch not in _MOE:
        raise UnsupportedArchitectureError(
            f"{what} of GGUF architecture {arch!r}, which llmctl does not read",
            f"llmctl reads GGUF mixtures of experts of {', '.join(sorted(_MOE))}; serve the "
            "model's safetensors directory instead",
        )
    if not any(".ffn_gate_exps." in name for name in tensor_names):
        raise UnsupportedArchitectureError(
            f"{what} without stacked expert tensors (blk.N.ffn_gate_exps.weight): an old "
            "llama.cpp layout of one tensor per expert",
            "convert it again with a current llama.cpp, or serve the model's safetensors "
            "directory instead of its GGUF file",
        )


def moe_config_values(arch: str, shape: ModelShape) -> dict[str, Any]:
    """The Hugging Face config keys of a MoE file beyond shape.hf_config_values(): model_type,
    architectures and the experts' sizes ({} for a dense model)."""
    if not shape.num_experts:
        return {}
    model_type, architecture, _, _ = _MOE[arch]
    values: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "num_experts_per_tok": shape.num_experts_per_tok,
    }
    if model_type == "mixtral":
        values["num_local_experts"] = shape.num_experts
        return values
    values.update(
        num_experts=shape.num_experts,
        moe_intermediate_size=shape.expert_intermediate_size,
        norm_topk_prob=model_type == "qwen3_moe",  # as llama.cpp routes each
        decoder_sparse_step=1,  # llama.cpp runs every layer as MoE
        mlp_only_layers=[],
    )
    if model_type == "qwen2_moe":
        values["shared_expert_intermediate_size"] = shape.shared_expert_intermediate_size
    return values


def moe_tensors(hf_name: str, t, float_reader, dequantize: bool) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of GGUF tensor `t` (gguf_file.GGUFTensorInfo): each expert of a
    stacked tensor of shape [E, rows, columns] (`hf_name` holding EXPERT), or the shared expert
    gate [H] as [1, H]. Float tensors are read through `float_reader(t)` (index -> float32 torch
    tensor; the whole tensor is converted once for all experts); quantized ones keep their
    blocks, each expert's rows."""
    from llmctl.engine.layers.checkpoint_tensor import CheckpointTensor, QuantizedCheckpointTensor

    is_float = t.type_name in ("F32", "F16", "BF16") or dequantize
    if EXPERT not in hf_name:  # is_vector_shared_expert_gate(t)
        read = float_reader(t)
        yield hf_name, CheckpointTensor(hf_name, (1, *t.shape), lambda i: read(...)[None][i])
        return
    num_experts, rows, columns = t.shape
    read = float_reader(t) if is_float else None
    for e in range(num_experts):
        name = hf_name.replace(EXPERT, str(e))
        if is_float:
            yield name, CheckpointTensor(name, (rows, columns), lambda i, e=e: read((e, *i)))
        else:  # each expert's rows of blocks, decoded on loading
            blocks = t.data[e * rows : (e + 1) * rows]
            yield name, QuantizedCheckpointTensor(name, t.type_name, (rows, columns), blocks)


def is_vector_shared_expert_gate(t) -> bool:
    """Qwen2-MoE's shared expert gate stored as [H] (llama.cpp's shape; HF's is [1, H])."""
    return t.name.endswith(".ffn_gate_inp_shexp.weight") and len(t.shape) == 1


def is_stacked_experts(gguf_name: str) -> bool:
    """blk.N.ffn_{gate,up,down}_exps.weight: every expert's matrix in one tensor."""
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _STACKED
