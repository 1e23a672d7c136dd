"""Attention: the layer model code calls and the kernels behind it, chosen once. `layer.Attention`
holds a layer's paged KV cache and reads the step's `metadata.AttentionMetadata` (slot mapping,
decode and prefill block tables and lengths, built once per step by the model runner) from the
forward context; `selector.get_attn_backend` picks one backend per model runner
(LLMCTL_ATTENTION_BACKEND: Triton on CUDA, the torch backend with the C++ paged decode kernel on the
CPU), which the runner binds to every layer with its cache (`backends/`), so model code never asks
which kernel runs. The kernels themselves are in engine/kernels/.
"""
