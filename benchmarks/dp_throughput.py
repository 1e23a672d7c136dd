"""Data-parallel serving throughput: `llmctl serve --data-parallel-size 2` against 1, side by side.

Starts two `llmctl serve` on the bundled SmolLM2-135M, one with -dp 1 and one with -dp 2 (each on
its own port), warms each with a full round of `--concurrency` short requests, then loads them in
turn, `--rounds` times (dp=1, dp=2, dp=1, dp=2, ...: on a shared machine both see the same drift
in load), the idle one waiting. A round: `--requests` (128) streaming completions (prompts of
`--prompt-len` random token ids, `--output-len` tokens each, EOS ignored), `--concurrency` (32)
in flight, through the official openai client; every request must return all its tokens. Prints
each round's requests/s, output tokens/s, TTFT and ITL p50, and how the dp=2 server spread the
round's prompt tokens over its replicas (/metrics, label `replica`), the machine's load average
around it, and the ratio dp=2 / dp=1 of the best rounds' output tokens/s (and per round).

On a CPU each replica's workers get cores / 2 torch threads (one core each on a 2-core machine):
the ratio measures what splitting the cores into two engines buys over one engine with all of
them (on GPUs each replica has its own devices, and the ratio approaches 2).

`--across-nodes` adds a third server to the rounds: dp=2 with replica 1 on a second "node"
(`llmctl serve --headless --data-parallel-start-rank 1`, joined over 127.0.0.1), the head pinned
to the first half of the cores and the node to the other half (taskset), so each replica has the
threads it has in the one-node dp=2 run: the difference is what driving a replica over its socket
costs.

    python benchmarks/dp_throughput.py                      # 2 rounds of 128 requests at 32
    python benchmarks/dp_throughput.py --requests 8 --concurrency 4 --output-len 8 --rounds 1
    python benchmarks/dp_throughput.py --across-nodes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve import make_prompts, run_load  # noqa: E402

LLMCTL = str(Path(sys.executable).with_name("llmctl"))


def start_server(
    port: int, dp: int, kv_gib: float, extra: tuple[str, ...] = (), prefix: tuple[str, ...] = ()
) -> subprocess.Popen:
    import httpx

    cmd = [*prefix, LLMCTL, "-q", "serve", "--port", str(port), "--served-model-name", "bench"]
    cmd += ["--kv-cache-space-gib", str(kv_gib), "--data-parallel-size", str(dp), *extra]
    # A busy shared machine can stretch one step past the default 30 s stall timeout.
    cmd += ["--stall-timeout", "600"]
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


def halves() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """taskset prefixes pinning two processes to the two halves of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    first, second = cores[:half], cores[half:] or cores[:half]
    return (("taskset", "-c", ",".join(map(str, first))),
            ("taskset", "-c", ",".join(map(str, second))))  # fmt: skip


def start_two_nodes(port: int, kv_gib: float) -> list[subprocess.Popen]:
    """dp=2 with replica 1 on a --headless "node" on the other half of the cores: [node, head]."""
    from llmctl.engine.distributed.ports import free_port

    rpc = ("--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port()))
    head_cores, node_cores = halves()
    node = subprocess.Popen(
        [*node_cores, LLMCTL, "-q", "serve", "--served-model-name", "bench",
         "--kv-cache-space-gib", str(kv_gib), "-dp", "2", "--data-parallel-size-local", "1",
         "--data-parallel-start-rank", "1", *rpc, "--headless"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        head = start_server(port, 2, kv_gib, ("--data-parallel-size-local", "1", *rpc), head_cores)
    except BaseException:
        node.terminate()
        raise
    return [node, head]


def prompt_tokens_per_replica(port: int) -> dict[str, float]:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    pattern = r'llmctl:prompt_tokens_total\{.*replica="(\d+)".*\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def measure(port: int, args, seed: int) -> dict:
    """One round on the server at `port`: the load, and each replica's share of its prompts."""
    url = f"http://127.0.0.1:{port}/v1"
    before = prompt_tokens_per_replica(port)
    load_before = os.getloadavg()[0]
    prompts = make_prompts(args.requests, args.prompt_len, seed=seed)
    result = asyncio.run(run_load(url, prompts, args.concurrency, args.output_len))
    expected = args.requests * args.output_len
    if result["tokens"] != expected:
        raise SystemExit(f"{result['tokens']} output tokens came back, {expected} expected")
    after = prompt_tokens_per_replica(port)
    result["prompt_tokens_by_replica"] = {r: after[r] - before.get(r, 0.0) for r in after}
    result["load"] = (load_before, os.getloadavg()[0])
    print(f"  round {seed + 1}, dp on port {port}: {result['tok_per_s']:.1f} output tok/s",
          file=sys.stderr)  # fmt: skip
    return result


def report(args, rounds: list[tuple[str, dict]]) -> None:
    print(f"\nllmctl serve, SmolLM2-135M, {os.cpu_count()} cores: {args.requests} requests, "
          f"concurrency {args.concurrency}, prompts of {args.prompt_len} token ids, "
          f"{args.output_len} output tokens, streaming")  # fmt: skip
    print(f"  {'':14s} {'req/s':>7s} {'out tok/s':>10s} {'TTFT p50':>9s} {'ITL p50':>8s}  "
          "load avg   prompt tokens per replica")  # fmt: skip
    for dp, r in rounds:
        spread = ", ".join(
            f"{k}: {v:.0f}" for k, v in sorted(r["prompt_tokens_by_replica"].items())
        )
        print(f"  dp={dp:<11s} {r['req_per_s']:7.2f} {r['tok_per_s']:10.1f} "
              f"{r['ttft_p50'] * 1e3:7.0f}ms {r['itl_p50'] * 1e3:6.0f}ms  "
              f"{r['load'][0]:4.1f}-{r['load'][1]:<4.1f}  {spread}")  # fmt: skip
    labels = list(dict.fromkeys(label for label, _ in rounds))
    best = {label: max(r["tok_per_s"] for d, r in rounds if d == label) for label in labels}
    per_round = [
        f"{group[1][1]['tok_per_s'] / group[0][1]['tok_per_s']:.2f}x"
        for group in zip(*[rounds[i :: len(labels)] for i in range(len(labels))], strict=True)
    ]
    print(f"  dp=2 / dp=1 output tokens/s: {best['2'] / best['1']:.2f}x (best rounds); "
          f"per round: {', '.join(per_round)}")  # fmt: skip
    if TWO_NODES in best:
        print(f"  dp=2 on 2 nodes / dp=2 on one node, output tokens/s: "
              f"{best[TWO_NODES] / best['2']:.2f}x (best rounds)")  # fmt: skip


TWO_NODES = "2 (2 nodes)"


def main() -> None:
    from llmctl.engine.distributed.ports import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-space-gib", type=float, default=1.0)
    parser.add_argument(
        "--across-nodes", action="store_true", help="also dp=2 with replica 1 on a headless node"
    )
    args = parser.parse_args()
    servers: dict[str, tuple[int, list[subprocess.Popen]]] = {}
    # SIGTERM (a timeout) stops the servers too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    labels = ["1", "2"] + ([TWO_NODES] if args.across_nodes else [])
    try:
        for label in labels:
            port = free_port()
            print(f"starting llmctl serve -dp {label} on port {port}", file=sys.stderr)
            if label == TWO_NODES:
                servers[label] = port, start_two_nodes(port, args.kv_cache_space_gib)
            else:
                servers[label] = port, [start_server(port, int(label), args.kv_cache_space_gib)]
            # every batch size up to the concurrency seen once, on every replica
            warm = make_prompts(args.concurrency, args.prompt_len, seed=99)
            asyncio.run(run_load(f"http://127.0.0.1:{port}/v1", warm, args.concurrency, 8))
        rounds = [
            (label, measure(servers[label][0], args, seed=n))
            for n in range(args.rounds)
            for label in labels
        ]
    finally:
        processes = [p for _, group in servers.values() for p in reversed(group)]
        for process in processes:  # the head first: its node then ends with it
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
    report(args, rounds)


if __name__ == "__main__":
    main()
