"""Data-parallel serving throughput: `llmctl serve --data-parallel-size 2` against 1, side by side.

Starts `llmctl serve` on the bundled SmolLM2-135M with -dp 1, measures, stops it, then the same
with -dp 2 (each run a fresh server on its own port), on the same workload: `--requests`
streaming completions (prompts of `--prompt-len` random token ids, `--output-len` tokens each,
EOS ignored), `--concurrency` (32) in flight, through the official openai client. Prints
requests/s, output tokens/s, TTFT and ITL p50 for each, and the ratio dp=2 / dp=1, plus how the
dp=2 server spread the requests over its replicas (/metrics, label `replica`).

On a CPU each replica's workers get cores / 2 torch threads: the ratio measures what splitting
the cores into two engines buys over one engine with all of them (on GPUs each replica has its
own devices, and the ratio approaches 2).

`--across-nodes` adds a third run: dp=2 with replica 1 on a second "node" (`llmctl serve
--headless --data-parallel-start-rank 1`, joined over 127.0.0.1), the head pinned to the first
half of the cores and the node to the other half (taskset), so each replica has the threads it
has in the one-node dp=2 run: the difference is what driving a replica over its socket costs.

    python benchmarks/dp_throughput.py                      # 128 requests at concurrency 32
    python benchmarks/dp_throughput.py --requests 8 --concurrency 4 --output-len 8   # smoke
    python benchmarks/dp_throughput.py --across-nodes
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve import percentile  # noqa: E402

VOCAB = 49152


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(length)] for _ in range(count)]


async def run_load(base_url: str, prompts: list[list[int]], concurrency: int, output_len: int):
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
        "req_per_s": len(prompts) / wall,
        "tok_per_s": sum(tokens) / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "itl_p50": percentile(itls, 0.5),
    }


LLMCTL = str(Path(sys.executable).with_name("llmctl"))


def start_server(
    port: int, dp: int, kv_gib: float, extra: tuple[str, ...] = (), prefix: tuple[str, ...] = ()
) -> subprocess.Popen:
    import httpx

    cmd = [*prefix, LLMCTL, "-q", "serve", "--port", str(port), "--served-model-name", "bench"]
    cmd += ["--kv-cache-space-gib", str(kv_gib), "--data-parallel-size", str(dp), *extra]
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


def requests_per_replica(port: int) -> dict[str, float]:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    pattern = r'llmctl:prompt_tokens_total\{.*replica="(\d+)".*\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def halves() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """taskset prefixes pinning two processes to the two halves of this process's cores."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    first, second = cores[:half], cores[half:] or cores[:half]
    return (("taskset", "-c", ",".join(map(str, first))),
            ("taskset", "-c", ",".join(map(str, second))))  # fmt: skip


def measure(dp: int, args, across_nodes: bool = False) -> dict:
    from llmctl.engine.distributed.ports import free_port

    port = free_port()
    node, extra, prefix = None, (), ()
    if across_nodes:  # replica 1 on a --headless "node"
        rpc = ("--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port()))
        head_cores, node_cores = halves()
        node = subprocess.Popen(
            [
                *node_cores,
                LLMCTL,
                "-q",
                "serve",
                "--served-model-name",
                "bench",
                "--kv-cache-space-gib",
                str(args.kv_cache_space_gib),
                "-dp",
                str(dp),
                "--data-parallel-size-local",
                "1",
                "--data-parallel-start-rank",
                "1",
                *rpc,
                "--headless",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        extra, prefix = ("--data-parallel-size-local", "1", *rpc), head_cores
    server = start_server(port, dp, args.kv_cache_space_gib, extra, prefix)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        warm = make_prompts(2, args.prompt_len, seed=99)
        asyncio.run(run_load(url, warm, 2, 4))
        prompts = make_prompts(args.requests, args.prompt_len)
        result = asyncio.run(run_load(url, prompts, args.concurrency, args.output_len))
        result["prompt_tokens_by_replica"] = requests_per_replica(port)
        return result
    finally:
        server.terminate()
        server.wait(timeout=60)
        if node is not None:  # it ends with the head; terminate it if the head did not start
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.terminate()
                node.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-space-gib", type=float, default=1.0)
    parser.add_argument(
        "--across-nodes", action="store_true", help="also dp=2 with replica 1 on a headless node"
    )
    args = parser.parse_args()
    results = {str(dp): measure(dp, args) for dp in (1, 2)}
    if args.across_nodes:
        results["2 (2 nodes)"] = measure(2, args, across_nodes=True)
    print(f"\nllmctl serve, SmolLM2-135M: {args.requests} requests, concurrency "
          f"{args.concurrency}, prompts of {args.prompt_len} token ids, {args.output_len} "
          "output tokens, streaming")  # fmt: skip
    print(f"  {'':14s} {'req/s':>7s} {'out tok/s':>10s} {'TTFT p50':>9s} {'ITL p50':>8s}  "
          "prompt tokens per replica")  # fmt: skip
    for dp, r in results.items():
        spread = ", ".join(
            f"{k}: {v:.0f}" for k, v in sorted(r["prompt_tokens_by_replica"].items())
        )
        print(f"  dp={dp:<11s} {r['req_per_s']:7.2f} {r['tok_per_s']:10.1f} "
              f"{r['ttft_p50'] * 1e3:7.0f}ms {r['itl_p50'] * 1e3:6.0f}ms  {spread}")  # fmt: skip
    ratio = results["2"]["tok_per_s"] / results["1"]["tok_per_s"]
    print(f"  dp=2 / dp=1 output tokens/s: {ratio:.2f}x")
    if args.across_nodes:
        ratio = results["2 (2 nodes)"]["tok_per_s"] / results["2"]["tok_per_s"]
        print(f"  dp=2 on 2 nodes / dp=2 on one node, output tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
