"""Weight-only quantization: GGUF block formats read natively and `--quantization int8|int4`.
Weights stay packed in memory (4 or 8 bits per weight plus per-group scales); activations stay
float. `quant_config` says how a model's weights are stored, `linear_method` and `moe_method` keep
a layer's or an expert's weights packed, `gguf_quants` and `rtn` convert GGUF blocks and float
rows into the packed format; the packed weight and its matmul are in
engine/kernels/cpu/quantized_matmul.py (Triton's on CUDA). The layers call `matmul(x)`.
"""
