"""The CPU kernels. C++ sources with AVX-512, AVX2 and scalar paths (`paged_attention_cpu.cpp`,
`quantized_matmul_cpu.cpp`, `fused_decode_cpu.cpp`) are compiled once per machine by `cpu_extension`
(torch.utils.cpp_extension, into a cache named by a hash of everything the binary depends on;
LLMCTL_CPU_MARCH, LLMCTL_CACHE_DIR) and loaded as torch ops; `cpu_kernels` builds them all (`python
-m llmctl.engine.kernels.cpu.cpu_kernels`, which `make setup` runs). Their Python sides:
`paged_attention_cpu` (decode attention over the paged cache, gather + SDPA as the fallback),
`quantized_matmul` (PackedLinearWeight: the packed group format every quantized weight is converted
to, and its matmul) and `fused_decode` (a Llama-family stage's decode step in one call). A kernel
that does not build leaves its part on a plain-torch path, with one warning saying why.
"""
