"""Attention backends: the kernels behind the Attention layer, one object per model runner.

`selector.get_attn_backend(device)` picks one when the model runner is built; the runner binds it
to every Attention layer with the KV cache, so model code never asks which kernel runs. Each
backend writes the step's new keys and values into the paged cache and attends over it:
- `triton.TritonAttentionBackend`: Triton kernels (reshape_and_cache, paged decode, prefill) through
  torch custom ops, so CUDA graphs capture them; the default on CUDA.
- `torch_sdpa.TorchSDPABackend`: index_copy_ writes, gather + scaled_dot_product_attention; CUDA
  without Triton, or LLMCTL_ATTENTION_BACKEND=torch there.
- `cpu.CPUAttentionBackend`: the torch backend with the C++ paged decode kernel
  (kernels/cpu/paged_attention_cpu); the default on the CPU.
Adding a backend: a subclass of `base.AttentionBackend`, and a line in `selector.py`.
"""
