"""The block-FP8 GEMM and the MLA decode kernel compiled for an H100 (sm_90) and an L40S / RTX
4090 (sm_89) on any machine, with Triton's ahead-of-time compiler (no GPU needed; see
test_triton_compile.py): the GEMM's dot becomes FP8 tensor-core instructions (wgmma on sm_90,
mma.sync ... e4m3 on sm_89), not float16 ones, and every kernel fits a block's shared memory.
What the kernels compute is checked in the interpreter (test_fp8_matmul.py, test_triton_mla.py);
their speed needs a GPU.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

import pytest

GEMM_POINTERS = {"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "as_ptr": "fp32", "bs_ptr": "fp32",
                 "y_ptr": "bf16"}  # fmt: skip
MLA_POINTERS = {"out_ptr": "bf16", "part_max_ptr": "fp32", "part_sum_ptr": "fp32",
                "part_out_ptr": "fp32", "ql_ptr": "bf16", "qr_ptr": "bf16", "cache_ptr": "bf16",
                "block_tables_ptr": "i32", "seq_lens_ptr": "i32"}  # fmt: skip
MULTIPLES_OF_16 = {"K", "stride_am", "stride_bn", "stride_cb", "stride_co"}
# name -> (module, kernel, pointer types, constexprs, launch options, compute capability)
CONFIGS = {
    **{
        f"fp8-gemm-m{bm}-sm{cc}": ("triton_fp8_gemm", "_gemm_kernel", GEMM_POINTERS,
                                   dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128),
                                   {"num_warps": 4 if bm == 64 else 8, "num_stages": 3}, cc)
        for bm in (64, 128)
        for cc in (90, 89)
    },
    "fp8-quant-sm90": ("triton_fp8_gemm", "_quant_kernel",
                       {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
                       dict(GROUP=128, BLOCK=128), {}, 90),
    **{
        f"mla-decode-p{parts}-sm90": ("triton_mla", "_decode_kernel", MLA_POINTERS,
                                      dict(BLOCK_H=16, BLOCK_L=512, BLOCK_R=64, BLOCK_N=16,
                                           NUM_PARTITIONS=parts, UPCAST=False,
                                           DOT_PRECISION="tf32"), {"num_warps": 8}, 90)
        for parts in (1, 8)
    },
}  # fmt: skip


def _build_all() -> dict[str, dict]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, (module, kernel_name, pointers, constexprs, options, cc) in CONFIGS.items():
        kernel = getattr(
            importlib.import_module(f"llmctl.engine.kernels.triton.{module}"), kernel_name
        )
        signature, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg in pointers:
                signature[arg] = "*" + pointers[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[arg] = "fp32" if arg == "qk_scale" else "i32"
                if arg in MULTIPLES_OF_16:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=options)
        except Exception as e:  # noqa: BLE001 - reported per config by the test
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        ops = re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", compiled.asm["ptx"])
        results[name] = {"shared": compiled.metadata.shared, "mma": dict(collections.Counter(ops))}
    return results


@pytest.fixture(scope="module")
def builds() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("fp8-gemm")])
def test_fp8_gemm_runs_on_fp8_tensor_cores(builds, name):
    build = builds[name]
    assert "error" not in build, build.get("error")
    fp8 = [op for op in build["mma"] if "e4m3" in op]
    assert fp8, f"no FP8 MMA: {build['mma']}"
    assert not [op for op in build["mma"] if ".f16.f16" in op], "FP8 widened to float16"
    limit = 227 if name.endswith("sm90") else 99
    assert build["shared"] <= limit * 1024


@pytest.mark.parametrize("name", [n for n in CONFIGS if not n.startswith("fp8-gemm")])
def test_quantization_and_mla_decode_compile(builds, name):
    build = builds[name]
    assert "error" not in build, build.get("error")
    assert build["shared"] <= 99 * 1024  # what a block may have on sm_86/89
    if name.startswith("mla"):
        assert build["mma"], "the MLA decode's dots run on tensor cores"


if __name__ == "__main__":
    print(json.dumps(_build_all()))
