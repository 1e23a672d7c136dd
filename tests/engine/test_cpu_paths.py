"""Each CPU code path (platform.cpu_path) on the bundled Q4_1 model: its native quantized weights
give the greedy tokens of the float path on the same weights dequantized, in the dtype the path
picks (bfloat16 against bfloat16, float32 against float32), with the fused decode stack running.

One machine runs the paths of older CPUs by hiding flags (LLMCTL_CPU_FLAGS_OFF: our side) and
capping oneDNN's instruction set (ONEDNN_MAX_CPU_ISA: torch's GEMMs and brgemm), each in its own
process (cpu_path_run.py); a path whose instructions this CPU lacks is skipped with the reason.

bfloat16 logits carry 8 significant bits: at SmolLM2's top logits (below 64) one unit in the last
place is at most 0.25, and two paths whose sums round differently meet ties and one-ulp gaps
there. In bfloat16 a first difference is accepted where the reference preferred its token by at
most that much (MAX_GAP_BF16); in float32 by MAX_GAP, as everywhere else.

Zen 4's default (avx512_bf16 with AVX512-VNNI) multiplies prefill batches' activations as int8,
quantized per 32 values (kernels/cpu/int8_gemm.cpp): its tokens are held to the same bfloat16
float path by the same rule, and the same path with LLMCTL_CPU_INT8_PREFILL=0 (bfloat16
prefill) is run as its own case. The AVX2 path's default does the same for prefill batches on
4-bit weights (VPMADDUBSW): int8 activations carry about as many bits as bfloat16's
significand (a step of amax / 127 in a block), so its float32 tokens are held by the bfloat16
rule (MAX_GAP_INT8), and with LLMCTL_CPU_INT8_PREFILL=0 (float32 throughout) by MAX_GAP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import MAX_GAP

from llmctl.engine.platform import cpu_flags

pytestmark = pytest.mark.slow

MAX_GAP_BF16 = 0.25  # one bfloat16 ulp of a logit below 64
MAX_GAP_INT8 = MAX_GAP_BF16  # int8 activations (per 32 values): about bfloat16's resolution
HERE = Path(__file__).resolve().parent
AVX512_BF16 = {"LLMCTL_CPU_FLAGS_OFF": "amx*", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
AVX2 = {"LLMCTL_CPU_FLAGS_OFF": "avx512*,amx*", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# name: (the CPU path, the flags it needs, the environment that selects it here, its dtype, the
# prefill GEMM it runs: quantized_matmul.prefill_gemm)
PATHS = {
    "amx": ("amx", {"amx_bf16", "amx_tile"}, {}, "bfloat16", "amx"),
    # Zen 4's default: prefill batches on int8 activations, held to the float path's tokens too
    "avx512_bf16-int8": (
        "avx512_bf16",
        {"avx512_bf16", "avx512_vnni"},
        AVX512_BF16,
        "bfloat16",
        "int8",
    ),
    "avx512_bf16": (
        "avx512_bf16",
        {"avx512_bf16"},
        {**AVX512_BF16, "LLMCTL_CPU_INT8_PREFILL": "0"},
        "bfloat16",
        None,
    ),
    # the AVX2 kind's default: prefill batches on int8 activations (4-bit weights)
    "avx2-int8": ("avx2", {"avx2", "fma"}, AVX2, "float32", "int8"),
    "avx2": ("avx2", {"avx2", "fma"}, {**AVX2, "LLMCTL_CPU_INT8_PREFILL": "0"}, "float32", None),
}


def as_outputs(rows: list[dict]) -> list:
    """The JSON rows in RequestOutput's shape."""
    outputs = []
    for row in rows:
        logprobs = [
            {int(t): SimpleNamespace(logprob=v) for t, v in step.items()}
            for step in row["logprobs"]
        ]
        seq = SimpleNamespace(token_ids=row["token_ids"], logprobs=logprobs)
        outputs.append(SimpleNamespace(outputs=[seq]))
    return outputs


def first_differences(native: list, reference: list) -> list[tuple[int, int, float]]:
    """(sequence, position, the reference's logprob gap) where the greedy tokens first part."""
    found = []
    for i, (got, want) in enumerate(zip(native, reference, strict=True)):
        got, want = got.outputs[0], want.outputs[0]
        if got.token_ids == want.token_ids:
            continue
        pos = next(
            p for p, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b
        )
        step = want.logprobs[pos]
        other = got.token_ids[pos]
        assert other in step, f"sequence {i}, position {pos}: {other} is not in the top 5"
        found.append((i, pos, step[want.token_ids[pos]].logprob - step[other].logprob))
    return found


@pytest.mark.parametrize("name", list(PATHS))
def test_quantized_weights_give_the_float_paths_tokens(name):
    path, needs, env, dtype, prefill = PATHS[name]
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}: the {name} path cannot run here")
    done = subprocess.run(
        [sys.executable, str(HERE / "cpu_path_run.py")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    native, reference = result["native"], result["reference"]
    assert (result["path"], result["prefill"]) == (path, prefill)
    assert (native["dtype"], reference["dtype"]) == (dtype, dtype)
    assert (native["quantization"], reference["quantization"]) == ("gguf", None)
    assert native["fused"] == reference["fused"] == "DecodeStack"  # both decoded in one C++ call
    # the AVX2 path's int8 activations: the native model's packed weights, made for them
    assert native["int8_act"] == [path == "avx2" and prefill == "int8"]
    assert reference["int8_act"] == []  # float weights
    gaps = first_differences(as_outputs(native["outputs"]), as_outputs(reference["outputs"]))
    print(f"{name}: {len(gaps)} of {len(native['outputs'])} sequences part: {gaps}")
    if dtype == "bfloat16":
        limit = MAX_GAP_BF16
    else:
        limit = MAX_GAP_INT8 if prefill == "int8" else MAX_GAP
    assert all(gap <= limit for _, _, gap in gaps), f"gaps above {limit}: {gaps}"
