"""Block-FP8 checkpoints written for the tests, as DeepSeek-V3 ships them: each decoder layer's
linear weight (attention projections, dense and shared MLPs, every expert's 2-D matrices) in
float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (partial at the edges),
quantized per block from a saved float model's own tensors; embeddings, norms, routers and the
LM head stay float; config.json says quant_method "fp8". Next to it, the float checkpoint of the
same weights dequantized: what transformers runs as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

from support import VOCAB

from llmctl.engine.layers.quantization.fp8 import dequantize_blocks, quantize_blocks

BLOCK = (128, 128)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}


def is_fp8_tensor(name: str) -> bool:
    """The tensors DeepSeek-V3's FP8 checkpoint stores in FP8: the decoder layers' `*_proj`
    matrices, kv_a_proj_with_mqa included (the routers `mlp.gate`, the norms and the embeddings
    stay float)."""
    return ".layers." in name and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_fp8(float_dir: Path, fp8_dir: Path, dequantized_dir: Path) -> None:
    """From a saved float model: its block-FP8 checkpoint, and its dequantized float twin."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(float_dir / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, w in tensors.items():
        if is_fp8_tensor(name):
            q, scale_inv = quantize_blocks(w, BLOCK)
            fp8[name], fp8[f"{name}_scale_inv"] = q, scale_inv
            dequantized[name] = dequantize_blocks(q, scale_inv, BLOCK).to(w.dtype)
        else:
            fp8[name] = dequantized[name] = w
    for out, state in ((fp8_dir, fp8), (dequantized_dir, dequantized)):
        shutil.copytree(float_dir, out)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))


def fp8_configs() -> dict:
    """Tiny models whose splits at tp=2 fall on whole 128 x 128 blocks, hidden 192 (a partial
    block: 1.5 blocks of every layer's inputs, of o_proj's and down_proj's rows)."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=192, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256)  # fmt: skip
    return {
        "llama": LlamaConfig(
            **common, num_key_value_heads=2, head_dim=128, intermediate_size=256
        ),
        "qwen3-moe": Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=128, intermediate_size=256,
            moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        ),
        # q_a_proj 96 rows and q_b_proj 96 inputs, kv_a_proj_with_mqa 96 rows: partial blocks
        "deepseek-v3": DeepseekV3Config(
            **common, intermediate_size=256, moe_intermediate_size=256, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=32, v_head_dim=64,
        ),
    }  # fmt: skip
