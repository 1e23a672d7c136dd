"""Serving benchmark: the OpenAI API under load, and the offline engine on the same workload.

Starts `llmctl serve` on the bundled SmolLM2-135M, then for each concurrency level sends
4 x concurrency streaming completion requests (prompts of 32 token ids, 64 output tokens, EOS
ignored) through the official openai client, keeping `concurrency` in flight. Reports request
throughput, output tokens/s, time to first token and inter-token latency (p50, p99). Then runs
the offline engine (`LLM.generate`, fresh process) on the concurrency-16 workload, both with at
most 16 requests per batch (the same concurrency) and with all 64 at once, and prints the ratio.

    python benchmarks/serve.py
    python benchmarks/serve.py --levels 1,4,16 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN = 32
VOCAB = 49152


def make_prompts(count: int, length: int = PROMPT_LEN, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(length)] for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run_load(
    base_url: str, prompts: list[list[int]], concurrency: int, output_len: int
) -> dict:
    """Each prompt as one streaming completion (greedy, EOS ignored), `concurrency` in flight:
    output tokens, request and token rates, time to first token and inter-token latency."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    ttfts, itls, tokens = [], [], []

    async def one(prompt: list[int]) -> None:
        async with gate:
            start = time.perf_counter()
            stream = await client.completions.create(
                model="bench",
                prompt=prompt,
                max_tokens=output_len,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            last = None
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    tokens.append(chunk.usage.completion_tokens)
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                if last is None:
                    ttfts.append(now - start)
                else:
                    itls.append(now - last)
                last = now

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "requests": len(prompts),
        "tokens": sum(tokens),
        "req_per_s": len(prompts) / wall,
        "tok_per_s": sum(tokens) / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "itl_p50": percentile(itls, 0.5),
        "itl_p99": percentile(itls, 0.99),
    }


async def run_level(base_url: str, concurrency: int, output_len: int) -> dict:
    prompts = make_prompts(4 * concurrency, seed=concurrency)
    load = await run_load(base_url, prompts, concurrency, output_len)
    return {"concurrency": concurrency, **load}


def offline(concurrency: int, output_len: int, max_num_seqs: int | None) -> float:
    from llmctl.engine import LLM, SamplingParams

    kwargs = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    prompts = make_prompts(4 * concurrency, seed=concurrency)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with LLM(use_tqdm_on_load=False, kv_cache_space_gib=1.0, **kwargs) as llm:
        llm.generate(prompts[:2], params.replace(max_tokens=4), use_tqdm=False)
        llm.llm_engine.scheduler.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / wall


def start_server(port: int) -> subprocess.Popen:
    import httpx

    llmctl = str(Path(sys.executable).with_name("llmctl"))
    cmd = [llmctl, "-q", "serve", "--port", str(port), "--served-model-name", "bench"]
    cmd += ["--kv-cache-space-gib", "1"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--offline", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline:
        concurrency, seqs = (int(x) for x in args.offline.split(","))
        print(json.dumps(offline(concurrency, args.output_len, seqs or None)))
        return
    levels = [int(x) for x in args.levels.split(",")]
    server = start_server(args.port)
    try:
        results = [
            asyncio.run(run_level(f"http://127.0.0.1:{args.port}/v1", c, args.output_len))
            for c in levels
        ]
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"\nllmctl serve, SmolLM2-135M: prompts of {PROMPT_LEN} token ids, "
          f"{args.output_len} output tokens, streaming")  # fmt: skip
    print(f"  {'conc.':>5s} {'reqs':>5s} {'req/s':>7s} {'out tok/s':>10s} "
          f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s}")  # fmt: skip
    for r in results:
        print(
            f"  {r['concurrency']:5d} {r['requests']:5d} {r['req_per_s']:7.2f} "
            f"{r['tok_per_s']:10.1f} {r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms "
            f"{r['itl_p50'] * 1e3:6.0f}ms {r['itl_p99'] * 1e3:6.0f}ms"
        )
    if 16 in levels:
        served = next(r["tok_per_s"] for r in results if r["concurrency"] == 16)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        for seqs, label in ((16, "16 per batch"), (0, "all 64 at once")):
            cmd = [sys.executable, __file__, "--offline", f"16,{seqs}"]
            cmd += ["--output-len", str(args.output_len)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            rate = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"  offline engine, same 64 requests, {label}: {rate:.1f} tok/s; "
                  f"server at concurrency 16 = {served / rate:.0%} of it")  # fmt: skip


if __name__ == "__main__":
    main()
