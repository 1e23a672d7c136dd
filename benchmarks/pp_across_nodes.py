"""Pipeline stages across nodes vs on one host: `llmctl serve -pp 2`, both ways, side by side.

Two servers of the bundled SmolLM2-135M at pp=2 on this machine:

    one host   llmctl serve -pp 2                          (one process group: 2 workers)
    2 nodes    llmctl serve -pp 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 ...
               llmctl serve -pp 2 --nnodes 2 --node-rank 1 --headless ...   (over loopback)

Each is warmed with one round of `--concurrency` short requests, then they are loaded in turn,
`--rounds` times (one host, 2 nodes, one host, ...: on a shared machine both see the same drift
in load), the idle one waiting. A round: `--requests` streaming completions (`--prompt-len`
random token ids, `--output-len` tokens, EOS ignored) at `--concurrency`, through the openai
client. Prints each round's output tokens/s, ITL p50, the CPU seconds each worker process spent
per 100 output tokens (from /proc: time spent spinning while waiting shows here), the load
average, and the ratio 2 nodes / one host of the best rounds' output tokens/s.

The two nodes share one cluster secret (LLMCTL_CLUSTER_SECRET, made here for the run).

    python benchmarks/pp_across_nodes.py                   # 2 rounds of 64 requests at 16
    python benchmarks/pp_across_nodes.py --requests 16 --output-len 8 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dp_throughput import LLMCTL, make_prompts, run_load, start_server  # noqa: E402

ONE_HOST, TWO_NODES = "one host", "2 nodes"
ENGINE = ("-pp", "2", "--max-model-len", "512")
WORKER = "llmctl.engine.executor.multiproc"


def workers_of(root: int) -> list[int]:
    """The worker processes under `root` (its descendants running the mp worker)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            if WORKER in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            continue
        todo.extend(children.get(pid, []))
    return sorted(found)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_two_nodes(port: int, kv_gib: float) -> list[subprocess.Popen]:
    """Node 1 (--headless) and node 0 (the API) over loopback: [node 1, node 0]."""
    from llmctl.engine.distributed.ports import free_port

    master = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    node1 = subprocess.Popen(
        [LLMCTL, "-q", "serve", *ENGINE, *master, "--node-rank", "1", "--headless"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        node0 = start_server(port, 1, kv_gib, (*ENGINE, *master, "--node-rank", "0"))
    except BaseException:
        node1.terminate()
        raise
    return [node1, node0]


def measure(label: str, port: int, workers: list[int], args, seed: int) -> dict:
    load_before = os.getloadavg()[0]
    before = [cpu_seconds(pid) for pid in workers]
    prompts = make_prompts(args.requests, args.prompt_len, seed=seed)
    result = asyncio.run(
        run_load(f"http://127.0.0.1:{port}/v1", prompts, args.concurrency, args.output_len)
    )
    expected = args.requests * args.output_len
    if result["tokens"] != expected:
        raise SystemExit(f"{result['tokens']} output tokens came back, {expected} expected")
    spent = [cpu_seconds(pid) - b for pid, b in zip(workers, before, strict=True)]
    result["cpu_per_100"] = [100 * s / result["tokens"] for s in spent]
    result["load"] = (load_before, os.getloadavg()[0])
    print(f"  round {seed + 1}, {label}: {result['tok_per_s']:.1f} output tok/s", file=sys.stderr)
    return result


def report(args, rounds: list[tuple[str, dict]]) -> None:
    print(f"\nllmctl serve -pp 2, SmolLM2-135M, {os.cpu_count()} cores: {args.requests} "
          f"requests, concurrency {args.concurrency}, prompts of {args.prompt_len} token ids, "
          f"{args.output_len} output tokens, streaming")  # fmt: skip
    print(f"  {'':9s} {'out tok/s':>10s} {'ITL p50':>8s}  {'worker CPU s / 100 tok':>22s}  "
          "load avg")  # fmt: skip
    for label, r in rounds:
        cpu = ", ".join(f"{c:.2f}" for c in r["cpu_per_100"])
        print(f"  {label:9s} {r['tok_per_s']:10.1f} {r['itl_p50'] * 1e3:6.0f}ms  {cpu:>22s}  "
              f"{r['load'][0]:4.1f}-{r['load'][1]:<4.1f}")  # fmt: skip
    best = {
        label: max(r["tok_per_s"] for name, r in rounds if name == label)
        for label in (ONE_HOST, TWO_NODES)
    }
    print(f"  2 nodes / one host, output tokens/s: {best[TWO_NODES] / best[ONE_HOST]:.2f}x "
          "(best rounds)")  # fmt: skip


def main() -> None:
    from llmctl.engine.distributed.ports import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-space-gib", type=float, default=0.2)
    args = parser.parse_args()
    os.environ.setdefault("LLMCTL_CLUSTER_SECRET", secrets.token_hex(32))  # the servers inherit it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout stops the servers too
    servers: dict[str, tuple[int, list[subprocess.Popen]]] = {}
    try:
        for label in (ONE_HOST, TWO_NODES):
            port = free_port()
            print(f"starting {label} on port {port}", file=sys.stderr)
            if label == TWO_NODES:
                servers[label] = port, start_two_nodes(port, args.kv_cache_space_gib)
            else:
                servers[label] = port, [start_server(port, 1, args.kv_cache_space_gib, ENGINE)]
            warm = make_prompts(args.concurrency, args.prompt_len, seed=99)
            asyncio.run(run_load(f"http://127.0.0.1:{port}/v1", warm, args.concurrency, 8))
        workers = {
            label: [pid for p in group for pid in workers_of(p.pid)]
            for label, (_, group) in servers.items()
        }
        rounds = [
            (label, measure(label, servers[label][0], workers[label], args, seed=n))
            for n in range(args.rounds)
            for label in (ONE_HOST, TWO_NODES)
        ]
    finally:
        processes = [p for _, group in servers.values() for p in reversed(group)]
        for process in processes:  # node 0 first: node 1 then ends with it
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
    report(args, rounds)


if __name__ == "__main__":
    main()
