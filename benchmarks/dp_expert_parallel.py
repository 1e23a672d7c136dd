"""DP attention with expert-parallel MoE layers, offline: `-dp 2 --enable-expert-parallel` against
`-dp 2` (independent replicas, every expert in each) and one engine, side by side.

A random Mixtral (benchmarks/moe_vs_transformers.py's: hidden 512, 8 experts of 1024 features,
top-2, 4 layers by default) is saved once as safetensors; each layout loads it in float32 with
`LLM(...)` and generates a batch of `--batch` prompts of 32 random token ids, 64 greedy tokens
each (EOS ignored), after a short warm-up, `--rounds` times in turn (dp=1, dp=2, dp=2+EP, ...: on a
shared machine each sees the same drift in load). Prints each round's output tokens/s, the
weights each worker holds (EP: half the experts per replica), and whether every layout's tokens
agree with dp=1's.

    python benchmarks/dp_expert_parallel.py                   # batch 32, 2 rounds
    python benchmarks/dp_expert_parallel.py --batch 8 --output-len 16 --rounds 1

On a CPU each replica's worker gets cores / 2 torch threads; with EP every MoE layer adds an
all-gather and an all-reduce between the replicas (Gloo over loopback) and the replicas step
together, so the comparison is what sharing the experts costs in time for the memory it saves.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from moe_vs_transformers import save_model  # noqa: E402

LAYOUTS = {
    "dp=1": {},
    "dp=2": {"data_parallel_size": 2},
    "dp=2+EP": {"data_parallel_size": 2, "enable_expert_parallel": True},
}


def worker_weights(llm) -> list[int]:
    replicas = [r.engine for r in llm._dp.replicas] if llm._dp else [llm.llm_engine]
    return [info["weight_bytes"] for e in replicas for info in e.executor.rank_info()]


def run(path: Path, kwargs: dict, prompts, args) -> tuple[float, list[list[int]], list[int]]:
    from llmctl.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.5,
        skip_tokenizer_init=True,
        **kwargs,
    ) as llm:
        llm.generate(prompts[:4], warm, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        weights = worker_weights(llm)
    tokens = [o.outputs[0].token_ids for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 32000) for _ in range(32)] for _ in range(args.batch)]
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as root:
        path = save_model("mixtral", args, Path(root))
        reference = None
        best: dict[str, float] = {}
        for round_ in range(1, args.rounds + 1):
            for name, kwargs in LAYOUTS.items():
                tok_s, tokens, weights = run(path, kwargs, prompts, args)
                reference = reference or tokens
                best[name] = max(best.get(name, 0.0), tok_s)
                mib = ", ".join(f"{w / 2**20:.1f}" for w in weights)
                same = sum(a == b for a, b in zip(tokens, reference, strict=True))
                print(
                    f"round {round_} {name:8s} {tok_s:8.1f} output tok/s  weights per worker "
                    f"[{mib}] MiB  {same}/{len(tokens)} sequences as dp=1"
                )
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("best: " + ", ".join(f"{name} {tok_s:.1f} tok/s" for name, tok_s in best.items()))
    print(f"dp=2+EP / dp=2: {best['dp=2+EP'] / best['dp=2']:.2f}")


if __name__ == "__main__":
    main()
