"""Parallel layouts side by side: offline throughput and per-rank memory on SmolLM2-135M.

Workload (issue #3): 64 prompts of 32 token ids, 128 greedy output tokens each, EOS ignored.
Layouts: tp=1 (one process), tp=2 and pp=2 on the mp backend and on Ray, pp=2 with and without
pipelining of batches (with pipelining, up to pp batches are in flight so both stages work at
once). Each layout runs in a fresh process. On a 2-core machine no speed-up is expected: the aim
is that the parallel layouts keep at least 70% of tp=1's throughput, and that the per-rank weight
memory at tp=2 is at most 60% of tp=1's.

    python benchmarks/parallel.py
    python benchmarks/parallel.py --output-len 64 --skip-ray
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LAYOUTS = [
    # name, engine keywords
    ("tp=1", {"tensor_parallel_size": 1}),
    ("tp=2 mp", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
    ("pp=2 mp", {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}),
    (
        "pp=2 mp, no pipelining",
        {
            "pipeline_parallel_size": 2,
            "distributed_executor_backend": "mp",
            "max_concurrent_batches": 1,
        },
    ),
    ("tp=2 ray", {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}),
    ("pp=2 ray", {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}),
    (
        "pp=2 ray, no pipelining",
        {
            "pipeline_parallel_size": 2,
            "distributed_executor_backend": "ray",
            "max_concurrent_batches": 1,
        },
    ),
]


def run_layout(layout: dict, batch: int, prompt_len: int, output_len: int) -> dict:
    import torch

    from llmctl.engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 49152, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with LLM(use_tqdm_on_load=False, kv_cache_space_gib=1.0, **layout) as llm:
        llm.generate(prompts[:2], params.replace(max_tokens=4), use_tqdm=False)  # warm-up
        llm.llm_engine.scheduler.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        info = llm.llm_engine.executor.rank_info()
        dtype = llm.llm_engine.config.model_config.dtype
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "dtype": dtype,
        "weight_bytes": max(r["weight_bytes"] for r in info),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in info),
        "first_ids": outputs[0].outputs[0].token_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--only", help="comma-separated layout names, e.g. 'tp=1,tp=2 mp'")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        layout = json.loads(args.child)
        print(json.dumps(run_layout(layout, args.batch, args.prompt_len, args.output_len)))
        return
    results = {}
    for name, layout in LAYOUTS:
        if args.skip_ray and layout.get("distributed_executor_backend") == "ray":
            continue
        if args.only and name not in args.only.split(",") and name != "tp=1":
            continue
        cmd = [sys.executable, __file__, "--child", json.dumps(layout)]
        cmd += ["--batch", str(args.batch), "--prompt-len", str(args.prompt_len)]
        cmd += ["--output-len", str(args.output_len)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-3000:])
            raise SystemExit(f"layout {name} failed")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results["tp=1"]
    base_rate = base["tokens"] / base["seconds"]
    print(
        f"\n{args.batch} prompts x {args.prompt_len} tokens -> {args.output_len} tokens, "
        f"SmolLM2-135M, {base['dtype']}"
    )
    header = f"  {'layout':26s} {'tok/s':>8s} {'vs tp=1':>8s}"
    print(f"{header} {'weights/rank':>13s} {'peak RSS/rank':>14s}")
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"]
        same = "" if r["first_ids"] == base["first_ids"] else "  (first sequence differs)"
        print(
            f"  {name:26s} {rate:8.1f} {rate / base_rate:7.0%} "
            f"{r['weight_bytes'] / 2**20:10.1f} MiB {r['peak_rss_bytes'] / 2**20:11.1f} MiB{same}"
        )
    if "tp=2 mp" in results:
        share = results["tp=2 mp"]["weight_bytes"] / base["weight_bytes"]
        print(f"  per-rank weights at tp=2: {share:.0%} of tp=1")


if __name__ == "__main__":
    main()
