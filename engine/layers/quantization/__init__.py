"""Quantized weights: GGUF block formats read natively, `--quantization int8|int4`, and block FP8
(checkpoints that ship it, `--quantization fp8`). Weights stay packed in memory (4 or 8 bits per
weight plus per-group scales); activations stay float (FP8 on CUDA: quantized per token and group
for the FP8 GEMM). `quant_config` says how a model's weights are stored, `linear_method` and
`moe_method` keep a layer's or an expert's weights packed, `gguf_quants`, `rtn` and `fp8` convert
GGUF blocks, float rows and FP8 blocks into the packed formats; the packed weights and their
matmuls are in engine/kernels/cpu/quantized_matmul.py and fp8_matmul.py (Triton's on CUDA). The
layers call `matmul(x)`.
"""
