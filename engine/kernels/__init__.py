"""Kernel sources and their builders, apart from the layers that call them: `cpu/` (C++ compiled
once per machine: paged decode attention, group-quantized matmuls, the fused decode stack) and
`triton/` (the GPU's paged attention, KV-cache write and group-quantized matmul, as torch custom
ops). Each kernel has a Python side here that layers and attention backends call, and a plain-torch
fallback where it cannot run.
"""
