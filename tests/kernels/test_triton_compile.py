"""The GPU kernels compiled for an H100 (sm_90) on any machine (the packed matmul, paged decode
and varlen prefill attention at their GPU tiles, the layers' fused RMSNorm, rotary and
SiLU-and-mul): Triton's ahead-of-time compiler and
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
# The attention and layer kernels' strides and sizes, as the JIT sees them for Llama-3-8B's
# contiguous tensors: row strides multiples of 16 elements, the last dimension's stride 1
# (which the JIT specializes as a constant).
UNIT_STRIDES = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "stride_od": 1}
MULTIPLES_OF_16 |= {
    "stride_qt", "stride_qh", "stride_kb", "stride_ko", "stride_kh", "stride_vb", "stride_vo",
    "stride_vh", "stride_ot", "stride_oh", "stride_os", "head_dim", "stride_x", "stride_r",
    "stride_o", "hidden", "stride_kt", "stride_cos", "d", "stride_bts", "stride_btc", "half",
}  # fmt: skip


def _configs() -> dict[str, tuple[str, dict, dict, dict]]:
    """name -> (kernel, pointer element types, constexprs, launch options), the fused matmul's
    tiles as group_mm picks them (fused_tiles) for 1, 64 and 256 rows of x."""
    import torch

    from llmctl.engine.kernels.triton.triton_group_mm import fused_tiles

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    configs = {}
    for bits, group in ((4, 32), (4, 128), (8, 32), (8, 16)):
        weights = {"q_ptr": "u8" if bits == 4 else "i8", "s_ptr": "fp16", "z_ptr": "fp16"}
        for activations, dtype in dtypes.items():
            for m in (1, 64, 256):
                tiles = fused_tiles(m, 4096, dtype)
                options = {key: tiles.pop(key) for key in ("num_warps", "num_stages")}
                pointers = {**weights, "x_ptr": activations, "y_ptr": "fp32"}
                constexprs = dict(
                    GROUP=group, SUB=min(group, tiles["BLOCK_K"]), BITS=bits, HAS_ZEROS=bits == 4,
                    UPCAST=False, DOT_PRECISION="ieee" if activations == "fp32" else "tf32",
                    **tiles,
                )  # fmt: skip
                name = f"group_mm-int{bits}-g{group}-{activations}-m{m}"
                configs[name] = (
                    "triton_group_mm",
                    "group_mm_kernel",
                    pointers,
                    constexprs,
                    options,
                )
        constexprs = dict(
            GROUP=group, SUB=min(group, 128), BITS=bits, HAS_ZEROS=bits == 4, BLOCK_N=32,
            BLOCK_K=128,
        )  # fmt: skip
        configs[f"dequantize-int{bits}-g{group}"] = (
            "triton_group_mm",
            "dequantize_kernel",
            {**weights, "w_ptr": "bf16"},
            constexprs,
            {},
        )
    configs.update(_attention_configs())
    configs.update(_layer_configs())
    return configs


def _attention_configs() -> dict:
    """Llama-3-8B's attention in bf16 (head_dim 128, 4 query heads per KV head): prefill at the
    tiles prefill_attention picks for a long prompt (with and without a window), a short chunk,
    and decode whole and split into partitions, with its merge."""
    import torch

    from llmctl.engine.kernels.triton.triton_attention import prefill_tiles

    caches = {
        "out_ptr": "bf16",
        "q_ptr": "bf16",
        "key_cache_ptr": "bf16",
        "value_cache_ptr": "bf16",
        "sinks_ptr": "fp32",
    }
    metadata = {"block_tables_ptr": "i32", "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32",
                "context_lens_ptr": "i32"}  # fmt: skip
    configs = {}
    for label, query_len, window, sinks in (
        ("long", 8192, False, False),
        ("window", 8192, True, False),
        ("short", 3, False, False),
        ("window-sinks", 8192, True, True),  # gpt-oss's sliding layers
    ):
        tiles = prefill_tiles(torch.bfloat16, 128, 4, query_len)
        options = {"num_warps": tiles.pop("num_warps")}
        constexprs = dict(
            GROUP=4, BLOCK_Q=tiles["BLOCK_M"] // tiles["GROUP_PAD"], BLOCK_D=128, PAD_D=False,
            USE_WINDOW=window, USE_SINKS=sinks, UPCAST=False, DOT_PRECISION="tf32", **tiles,
            **UNIT_STRIDES,
        )  # fmt: skip
        configs[f"prefill-{label}"] = (
            "triton_attention_kernels", "varlen_attention_kernel", {**caches, **metadata},
            constexprs, options, {"qk_scale": "fp32"},
        )  # fmt: skip
    for partitions in (1, 32):
        constexprs = dict(
            GROUP=4, BLOCK_G=16, BLOCK_D=128, BLOCK_N=32, NUM_PARTITIONS=partitions,
            USE_WINDOW=False, USE_SINKS=False, UPCAST=False, DOT_PRECISION="tf32",
            **UNIT_STRIDES,
        )  # fmt: skip
        pointers = {**caches, **metadata, "part_max_ptr": "fp32", "part_sum_ptr": "fp32",
                    "part_out_ptr": "fp32"}  # fmt: skip
        configs[f"decode-p{partitions}"] = (
            "triton_attention_kernels", "paged_decode_kernel", pointers, constexprs,
            {"num_warps": 4}, {"qk_scale": "fp32"},
        )  # fmt: skip
    configs["decode-merge"] = (
        "triton_attention_kernels", "merge_partitions_kernel",
        {"out_ptr": "bf16", "part_max_ptr": "fp32", "part_sum_ptr": "fp32", "part_out_ptr": "fp32",
         "sinks_ptr": "fp32"},
        {"NUM_PARTITIONS": 32, "BLOCK_P": 32, "BLOCK_D": 128, "USE_SINKS": False}, {},
    )  # fmt: skip
    return configs


def _layer_configs() -> dict:
    """The layers' fused kernels in bf16 at Llama-3-8B's sizes."""
    configs = {}
    for fused in (False, True):
        configs[f"rms_norm-fused{int(fused)}"] = (
            "triton_rms_norm", "_rms_norm_kernel",
            {"x_ptr": "bf16", "residual_ptr": "bf16", "out_ptr": "bf16", "weight_ptr": "bf16"},
            {"FUSED": fused, "BLOCK": 4096}, {"num_warps": 8}, {"eps": "fp32"},
        )  # fmt: skip
    configs["rotary"] = (
        "triton_rotary", "_rotary_kernel",
        {"positions_ptr": "i64", "q_ptr": "bf16", "k_ptr": "bf16", "cos_ptr": "fp32",
         "sin_ptr": "fp32"},
        {"BLOCK_H": 32, "BLOCK_D": 64}, {}, {},
    )  # fmt: skip
    configs["silu_and_mul"] = (
        "triton_activation", "_silu_and_mul_kernel", {"x_ptr": "bf16", "out_ptr": "bf16"},
        {"BLOCK": 1024}, {}, {},
    )  # fmt: skip
    return configs


CONFIGS = _configs()


def _build_all() -> dict[str, dict]:
    """Compile every config for sm_90 (in a process without TRITON_INTERPRET): its shared memory
    and memory operations, or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, (
        module_name,
        kernel_name,
        pointers,
        constexprs,
        options,
        *scalars,
    ) in CONFIGS.items():
        module = importlib.import_module(f"llmctl.engine.kernels.triton.{module_name}")
        kernel = getattr(module, kernel_name)
        scalar_types = scalars[0] if scalars else {}
        signature, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg in pointers:
                signature[arg] = "*" + pointers[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif arg in scalar_types:
                signature[arg] = scalar_types[arg]
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
            "vector_loads": len(re.findall(r"ld\.global(\.nc)?\.v[24]", ptx)),
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


@pytest.mark.parametrize(
    "name",
    [n for n in CONFIGS if n.startswith(("prefill", "decode", "rms_norm", "rotary", "silu"))],
)
def test_attention_and_layer_kernels_compile_for_h100(builds, name):
    build = builds[name]
    assert "error" not in build, build.get("error")
    assert build["cubin_bytes"] > 0
    assert build["shared"] <= 227 * 1024  # an H100 block's shared memory
    if not name.startswith("decode"):  # (decode's query row is gathered per head)
        assert build["scalar_2b_loads"] == 0, "rows read element by element, not as vectors"
    if name.startswith("prefill"):
        assert build["async_copies_16b"] >= 8, "K and V tiles: 16-byte asynchronous copies"


if __name__ == "__main__":
    print(json.dumps(_build_all()))
