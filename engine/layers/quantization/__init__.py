"""Weight-only quantization: GGUF block formats read natively and `--quantization int8|int4`.

Weights stay packed in memory (4 or 8 bits per weight plus per-group scales); activations stay
float. `kernels.py` holds the packed weight and its matmul; the layers call `matmul(x)`.
"""
