"""Memory of `llmctl serve` on the bundled Q4_1 GGUF, single stream (issue 15: peak RSS <= 400 MB).

Starts `llmctl serve` (defaults: the bundled SmolLM2-135M GGUF, native quantized weights), waits
for /health, then sends one request at a time: a 128-token completion, a chat reply, and
`--requests` more 128-token completions with distinct prompts (so each one takes new KV blocks
unless freed ones are reused). Reads the server's /proc status after each phase: VmRSS (resident
now), RssAnon / RssFile (heap and anonymous maps / mapped files such as libtorch), and VmHWM
(the peak resident set since start, loading included). With `--llamacpp-server PATH`, the same
requests go to llama.cpp's `llama-server` on the same GGUF, and its peak is printed beside ours.

    python benchmarks/serve_rss.py
    python benchmarks/serve_rss.py --requests 32
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TARGET_MB = 400


def status(pid: int) -> dict[str, float]:
    """The /proc status memory fields of `pid`, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not healthy within {timeout:g} s")


def run(argv: list[str], url: str, requests: int) -> list[tuple[str, dict[str, float]]]:
    import httpx

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    phases = []
    try:
        ready_s = wait_healthy(url, proc)
        phases.append((f"ready ({ready_s:.1f} s)", status(proc.pid)))
        completion = {"prompt": "The capital of France is", "max_tokens": 128, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=completion, timeout=600).raise_for_status()
        phases.append(("after a 128-token completion", status(proc.pid)))
        chat = {"messages": [{"role": "user", "content": "Hi, who are you?"}], "max_tokens": 64}
        httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=600).raise_for_status()
        phases.append(("after a chat reply", status(proc.pid)))
        for i in range(requests):
            story = {**completion, "prompt": f"Story number {i}: once upon a time"}
            httpx.post(f"{url}/v1/completions", json=story, timeout=600).raise_for_status()
        phases.append((f"after {requests} more completions", status(proc.pid)))
    finally:
        proc.terminate()
        proc.wait(60)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--llamacpp-server", help="a llama-server binary to measure beside ours")
    args = parser.parse_args()
    from llmctl.engine.model_loader.default_model import default_model_path

    gguf = str(default_model_path())
    llmctl = shutil.which("llmctl", path=os.path.dirname(sys.executable)) or "llmctl"
    sides = {"llmctl serve": [llmctl, "serve", gguf, "--port", str(args.port)]}
    if args.llamacpp_server:
        sides["llama-server"] = [args.llamacpp_server, "-m", gguf, "--port", str(args.port + 1)]
    print(f"model {gguf}, single stream, {os.cpu_count()} CPUs")
    for i, (name, argv) in enumerate(sides.items()):
        phases = run(argv, f"http://127.0.0.1:{args.port + i}", args.requests)
        print(f"\n{name}:")
        print(f"  {'phase':<34} {'VmRSS':>8} {'RssAnon':>8} {'RssFile':>8} {'VmHWM':>8}  (MB)")
        for phase, mem in phases:
            print(
                f"  {phase:<34} {mem['VmRSS']:8.1f} {mem['RssAnon']:8.1f} "
                f"{mem['RssFile']:8.1f} {mem['VmHWM']:8.1f}"
            )
        peak = max(mem["VmHWM"] for _, mem in phases)
        verdict = "meets" if peak <= TARGET_MB else "misses"
        target = f": {verdict} the {TARGET_MB} MB target" if name == "llmctl serve" else ""
        print(f"  peak RSS {peak:.1f} MB{target}")


if __name__ == "__main__":
    main()
