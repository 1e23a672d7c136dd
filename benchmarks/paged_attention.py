"""Decode attention per layer: the fused CPU kernel vs gather + scaled_dot_product_attention.

Shapes of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, block_size 16). Every sequence
holds `context` tokens in blocks scattered over a cache of at least 4 MiB of keys, as in an
engine after some churn. Each timed call uses the next of `--layers` distinct KV caches, as a
forward pass does, so a call does not find the blocks in cache from the call before (together
the caches outgrow the 32 MiB L3). The gather + SDPA side gets its block ids and mask
precomputed, as the model runner does once per step, so only the per-layer cost is timed.

    python benchmarks/paged_attention.py
    python benchmarks/paged_attention.py --batch 64 --context 160 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from llmctl.engine.kernels.cpu.paged_attention_cpu import (
    build_kernel,
    decode_sdpa_metadata,
    gathered_sdpa,
)
from llmctl.engine.platform import tune_cpu_allocator

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(batch: int, context: int, dtype: torch.dtype, layers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    block_bytes = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    num_blocks = max(batch * blocks_per_seq, (4 << 20) // block_bytes)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(layers)
    ]
    ids = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq]
    block_tables = ids.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, caches, block_tables, seq_lens


def time_per_call(fns: dict, layers: int, rounds: int, min_seconds: float) -> dict[str, float]:
    """Seconds per call of each fn(layer), the best of `rounds` rounds taken in turn, so that
    load from other processes hits every variant alike and the best round shows the code."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():  # warm-up
        for i in range(layers):
            fn(i)
    for _ in range(rounds):
        for name, fn in fns.items():
            calls, start = 0, time.perf_counter()
            while calls == 0 or time.perf_counter() - start < min_seconds / rounds:
                for i in range(layers):
                    fn(i)
                calls += layers
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def bench(batch: int, context: int, dtype: torch.dtype, args, kernel) -> tuple[float, float]:
    q, caches, tables, lens = make_case(batch, context, dtype, args.layers)
    scale = HEAD_DIM**-0.5
    block_ids, bias = decode_sdpa_metadata(tables, lens, BLOCK_SIZE, None, dtype)

    def run_kernel(i: int) -> torch.Tensor:
        return kernel(q, *caches[i], tables, lens, scale, None)

    def run_sdpa(i: int) -> torch.Tensor:
        return gathered_sdpa(q, *caches[i], block_ids, bias, scale)

    diff = (run_kernel(0).float() - run_sdpa(0).float()).abs().max().item()
    if diff > (1e-4 if dtype == torch.float32 else 3e-2):
        raise SystemExit(f"kernel and gather + SDPA disagree by {diff} at {batch}x{context}")
    best = time_per_call(
        {"kernel": run_kernel, "sdpa": run_sdpa}, args.layers, args.rounds, args.min_seconds
    )
    return best["kernel"], best["sdpa"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 160, 512])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=8, help="distinct KV caches to cycle")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="best of this many")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tune_cpu_allocator()  # as the engine's workers do
    start = time.perf_counter()
    kernel = build_kernel()
    print(f"kernel ready in {time.perf_counter() - start:.1f} s (built or loaded from cache)")
    print(
        f"threads {torch.get_num_threads()}; heads {NUM_HEADS} query / {NUM_KV_HEADS} KV, "
        f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; milliseconds per layer call"
    )
    row = "{:>9} {:>5} {:>7} {:>10} {:>15} {:>8}"
    print(row.format("dtype", "batch", "context", "kernel", "gather+SDPA", "speed-up"))
    for name in args.dtype:
        dtype = getattr(torch, name)
        for batch in args.batch:
            for context in args.context:
                kernel_s, sdpa_s = bench(batch, context, dtype, args, kernel)
                print(
                    row.format(
                        name,
                        batch,
                        context,
                        f"{kernel_s * 1e3:.3f}",
                        f"{sdpa_s * 1e3:.3f}",
                        f"{sdpa_s / kernel_s:.1f}x",
                    )
                )


if __name__ == "__main__":
    main()
