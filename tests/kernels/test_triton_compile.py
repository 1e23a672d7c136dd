"""The GPU kernels compiled for an H100 (sm_90) on any machine: Triton's ahead-of-time compiler and
the ptxas in its wheel need no GPU. Triton's interpreter (the other kernel tests, without a GPU)
checks what the kernels compute but never compiles them, so a kernel that only a real GPU would
refuse (a layout it cannot lower, too much shared memory) fails here first. Launches are compiled
as the JIT compiles them: 16-byte aligned pointers, K and strides multiples of 16.

The packed matmul is also held to how it reads memory: its weight and activation tiles arrive as
16-byte asynchronous copies into shared memory, and only a few scalar 2-byte loads remain (a
scale and a zero per 32-element chunk, not one per weight: the version that gathered them per
weight ran at 0.15x cuBLAS on an H100).

The builds run in a child process: under TRITON_INTERPRET=1 (set by tests/conftest.py without a
GPU) Triton's language is bound to its interpreter and cannot compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

MULTIPLES_OF_16 = {"K", "stride_xm", "stride_qn", "stride_sn", "k_per_split"}


def _configs() -> dict[str, tuple[str, dict, dict, dict]]:
    """name -> (kernel, pointer element types, constexprs, launch options), the fused matmul's
    tiles as group_mm picks them (fused_tiles) for 1 and 64 rows of x."""
    import torch

    from llmctl.engine.kernels.triton.triton_group_mm import fused_tiles

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    configs = {}
    for bits, group in ((4, 32), (4, 128), (8, 32), (8, 16)):
        weights = {"q_ptr": "u8" if bits == 4 else "i8", "s_ptr": "fp16", "z_ptr": "fp16"}
        for activations, dtype in dtypes.items():
            for m in (1, 64):
                tiles = fused_tiles(m, 4096, dtype)
                options = {key: tiles.pop(key) for key in ("num_warps", "num_stages")}
                pointers = {**weights, "x_ptr": activations, "y_ptr": "fp32"}
                constexprs = dict(
                    GROUP=group, SUB=min(group, tiles["BLOCK_K"]), BITS=bits, HAS_ZEROS=bits == 4,
                    UPCAST=False, DOT_PRECISION="ieee" if activations == "fp32" else "tf32",
                    **tiles,
                )  # fmt: skip
                name = f"group_mm-int{bits}-g{group}-{activations}-m{m}"
                configs[name] = ("group_mm_kernel", pointers, constexprs, options)
        constexprs = dict(
            GROUP=group, SUB=min(group, 128), BITS=bits, HAS_ZEROS=bits == 4, BLOCK_N=32,
            BLOCK_K=128,
        )  # fmt: skip
        configs[f"dequantize-int{bits}-g{group}"] = (
            "dequantize_kernel",
            {**weights, "w_ptr": "bf16"},
            constexprs,
            {},
        )
    return configs


CONFIGS = _configs()


def _build_all() -> dict[str, dict]:
    """Compile every config for sm_90 (in a process without TRITON_INTERPRET): its shared memory
    and memory operations, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmctl.engine.kernels.triton import triton_group_mm

    results = {}
    for name, (kernel_name, pointers, constexprs, options) in CONFIGS.items():
        kernel = getattr(triton_group_mm, kernel_name)
        signature, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg in pointers:
                signature[arg] = "*" + pointers[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[arg] = "i32"
                if arg in MULTIPLES_OF_16:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as e:  # noqa: BLE001 - reported per config by the test
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        ptx = compiled.asm["ptx"]
        results[name] = {
            "shared": compiled.metadata.shared,
            "async_copies_16b": len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*0x10", ptx)),
            "scalar_2b_loads": len(re.findall(r"ld\.global\.b16 ", ptx)),
            "vector_stores": len(re.findall(r"st\.global\.v[24]", ptx)),
            "cubin_bytes": len(compiled.asm["cubin"]),
        }
    return results


@pytest.fixture(scope="module")
def builds() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("group_mm")])
def test_group_mm_compiles_for_h100_and_reads_tiles_whole(builds, name):
    build = builds[name]
    assert "error" not in build, build.get("error")
    assert build["cubin_bytes"] > 0
    assert build["shared"] <= 99 * 1024  # what a block may have on sm_86/89 (227 KiB on H100)
    assert build["async_copies_16b"] >= 2, "weight and activation tiles: 16-byte async copies"
    assert build["scalar_2b_loads"] <= 8, "scales and zeros gathered per weight?"


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("dequantize")])
def test_dequantize_compiles_for_h100_and_writes_vectors(builds, name):
    build = builds[name]
    assert "error" not in build, build.get("error")
    assert build["scalar_2b_loads"] <= 8
    assert build["vector_stores"] >= 1, "dequantized rows: vector stores"


if __name__ == "__main__":
    print(json.dumps(_build_all()))
