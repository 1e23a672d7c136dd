"""The Triton kernels of the GPU path: `triton_attention` with `triton_attention_kernels` (paged
decode attention, split flash-decoding style when few sequences are long, and prefill attention over
the paged cache), `triton_kv_cache` (reshape_and_cache, the KV write that skips padding slots),
`triton_group_mm` (the group-quantized matmul: fused up to 64 rows, dequantize + cuBLAS above), and
`triton_ops`, which registers them as torch custom ops (llmctl::*) with fake implementations, so
CUDA graphs capture them and the device check runs a step without a GPU. On CPU tensors they run
only under Triton's interpreter (TRITON_INTERPRET=1), as the tests do.
"""
