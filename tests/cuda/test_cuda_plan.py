"""`llmctl plan` predicts the KV cache `llmctl generate --device cuda` then logs (the bundled
SmolLM2 in bfloat16 on one GPU), both as a user runs them.

Tolerance: the plan estimates what the engine measures (the profile step's peak activations, the
memory outside torch: the CUDA context), so the two KV caches may differ by that estimate's error;
the test allows 1 GiB, 1.4% of the 72 GiB that 0.9 x an 80 GB H100 gives. Memory this test process
holds on the GPU counts as the engine's non-torch memory, so it is measured and added back.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import free_gpu_memory

from llmctl.engine.config.memory_profile import GIB

pytestmark = pytest.mark.cuda

LLMCTL = str(Path(sys.executable).with_name("llmctl"))
TOLERANCE_BYTES = GIB


@pytest.fixture(autouse=True)
def _installed(smol_dir):
    """The commands as a user runs them: the llmctl script and the bundled SmolLM2."""
    if not Path(LLMCTL).exists():
        pytest.skip(f"the llmctl command is not installed next to {sys.executable}")


def _memory_of_this_process() -> int:
    """GPU memory held outside the engine's process when it starts: this test process's CUDA
    context and cached blocks, if it has any (None of it is touched when it has none)."""
    if not torch.cuda.is_initialized():
        return 0
    free_gpu_memory()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize(
    "step", [[], ["--max-num-batched-tokens", "32768", "--max-num-seqs", "512"]],
    ids=["default-step", "32k-token-step"],
)  # fmt: skip
def test_plan_predicts_the_gpu_kv_cache_the_engine_logs(step):
    others = _memory_of_this_process()
    engine = subprocess.run(
        [LLMCTL, "generate", "-p", "Hello", "--max-tokens", "4", "--device", "cuda",
         "--dtype", "bfloat16", *step],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert engine.returncode == 0, engine.stderr
    log = engine.stderr
    profiling = re.search(r"Memory profiling \(rank 0\): ([\d.]+) x ([\d.]+) GiB = .*", log)
    blocks = int(re.search(r"# KV cache blocks: (\d+) \(block size 16\)", log).group(1))
    tokens = re.search(r"GPU KV cache size: ([\d,]+) tokens", log).group(1)
    assert int(tokens.replace(",", "")) == blocks * 16
    assert re.search(r"Maximum concurrency for 8,192 tokens per request: [\d.]+x", log)
    utilization, total_gib = profiling.group(1), profiling.group(2)
    assert utilization == "0.9"

    plan = subprocess.run(
        [LLMCTL, "plan", "--gpus-per-node", "1", "--gpu-memory-gib", total_gib,
         "--dtype", "bfloat16", "--json", *step],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr
    predicted = json.loads(plan.stdout)
    assert (predicted["tensor_parallel_size"], predicted["pipeline_parallel_size"]) == (1, 1)
    block_bytes = predicted["ranks"][0]["kv_block_bytes"]

    # The engine's non-torch memory also holds this process's: add it back to compare.
    error = (predicted["num_kv_blocks"] - blocks) * block_bytes - others
    assert abs(error) <= TOLERANCE_BYTES, (
        f"plan {predicted['kv_cache_tokens']:,} tokens vs engine {blocks * 16:,} tokens "
        f"({error / GIB:+.2f} GiB beyond this process's {others / GIB:.2f} GiB)\n"
        f"engine: {profiling.group(0)}\nplan: " + "\n  ".join(predicted["memory"])
    )
