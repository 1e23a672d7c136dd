"""Ray backend vs mp backend on the test bed, beside pp=2 on one host: `cluster up` to the first
token, and throughput.

On real hosts of tests/e2e/cluster's test bed (network namespaces with their own sshd and Docker
daemon; needs root), for each layout in turn, with fresh containers:

    ray       llmctl cluster up -i inv                 (image llmctl:e2e, with Ray; 2 hosts)
              llmctl serve -i inv -pp 2 ...            (the head's server on the Ray backend)
    mp        llmctl cluster up -i inv --backend mp    (image llmctl:e2e-noray; 2 hosts)
              llmctl serve -i inv --backend mp -pp 2   (llmctl serve --nnodes 2 on each node)
    one host  the same as mp with an inventory of the first host alone: both stages on it

then one streaming completion: `up -> first token` is the wall time from `cluster up`'s start to
that completion's first token (containers, Ray or nothing, model load, KV cache, first step).
Then `--requests` streaming completions (`--prompt-len` random token ids, `--output-len` tokens,
EOS ignored) at `--concurrency` (16) through the openai client: requests/s, output tokens/s,
TTFT and ITL p50. `cluster down` between them. Prints the three side by side, mp / ray, and each
two-host backend / one host. The test bed's hosts share this machine's cores, so two hosts cannot
be faster than one; what the ratio shows is the cost of crossing hosts.

The model is the bundled SmolLM2-135M GGUF (pp=2: on two hosts, a stage per host). The images are
built by `llmctl image build --debootstrap [--no-ray]` (skipped when up to date) and loaded on
the hosts. `--env NAME=VALUE` adds to every node's environment: `--env OMP_WAIT_POLICY=` gives
the workers libgomp's default spin-waits back (an empty value is not one libgomp knows), which is
how they ran before they waited passively.

    sudo flock /work/notes/testbed.lock .venv/bin/python benchmarks/ray_vs_mp.py
    sudo .venv/bin/python benchmarks/ray_vs_mp.py --requests 16 --output-len 8   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e" / "cluster"))
sys.path.insert(0, str(Path(__file__).parent))
from dp_throughput import make_prompts, run_load  # noqa: E402

LLMCTL = str(Path(sys.executable).with_name("llmctl"))
IMAGES = {"ray": "llmctl:e2e", "mp": "llmctl:e2e-noray"}
PORT = 8011
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-space-gib", "0.2"]
ENGINE += ["--served-model-name", "bench"]
# A step of 16 sequences may take long on a shared 2-core machine: not a stall (the default 30 s
# ended an mp run once, while other work loaded the machine to 10).
ENGINE += ["--stall-timeout", "180"]


def llmctl(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run([LLMCTL, *args], capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"llmctl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def build_images(bed) -> None:
    import testbed_image

    hosts = [h.docker_host for h in bed.docker_hosts[:2]]
    for backend, tag in IMAGES.items():
        argv = [LLMCTL, "image", "build", "--debootstrap", "--tag", tag]
        argv += ["--no-ray"] if backend == "mp" else []
        subprocess.run(argv, check=True, capture_output=True, timeout=3600)
        testbed_image.load(bed.root, tag, hosts, log=lambda line: print(line, file=sys.stderr))


LAYOUTS = {  # name: (image's backend, hosts, ranks per host)
    "ray": ("ray", 2, 1),
    "mp": ("mp", 2, 1),
    "one host": ("mp", 1, 2),
}


def inventory(path: Path, bed, layout: str, model: str, env: dict[str, str]) -> Path:
    import yaml

    backend, count, gpus = LAYOUTS[layout]
    hosts = bed.docker_hosts[:count]
    doc = {
        "name": "bench",
        "image": IMAGES[backend],
        "model": model,
        "ssh": {"user": "root", "key": str(bed.client_key)},
        "nodes": [{"host": h.ip, "head": i == 0, "gpus": gpus} for i, h in enumerate(hosts)],
    }
    if env:
        doc["env"] = env
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def first_token(base_url: str) -> float:
    """Seconds until the first streamed token of one completion (time.monotonic() then)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model="bench", prompt="The capital of France is", max_tokens=4, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen = None
    async for chunk in stream:
        if seen is None and chunk.choices and chunk.choices[0].text:
            seen = time.monotonic()
    await client.close()
    return seen


def measure(layout: str, bed, model: str, args, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        inv = str(inventory(Path(tmp) / "bench.yaml", bed, layout, model, args.node_env))
        choice = ["--backend", "mp"] if LAYOUTS[layout][0] == "mp" else []
        head = bed.docker_hosts[0].ip
        url = f"http://{head}:{PORT}/v1"
        llmctl("cluster", "down", "-i", inv, env=env)  # fresh containers
        try:
            start = time.monotonic()
            llmctl("cluster", "up", "-i", inv, *choice, env=env)
            up = time.monotonic() - start
            serve = ["serve", "-i", inv, *choice, "-pp", "2", "--port", str(PORT), "--no-api-key"]
            llmctl(*serve, *ENGINE, env=env)
            ready = time.monotonic() - start
            token = asyncio.run(first_token(url)) - start
            prompts = make_prompts(args.requests, args.prompt_len)
            load = asyncio.run(run_load(url, prompts, args.concurrency, args.output_len))
            return {"up_s": up, "healthy_s": ready, "first_token_s": token, **load}
        finally:
            llmctl("cluster", "down", "-i", inv, env=env)


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE",
        help="add to every node's environment (OMP_WAIT_POLICY= : libgomp's default spin-waits)",
    )  # fmt: skip
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="which, comma-separated")
    args = parser.parse_args()
    args.node_env = dict(item.split("=", 1) for item in args.env)
    layouts = args.layouts.split(",")

    from testbed import Testbed, require_root

    from llmctl.engine.model_loader.default_model import default_model_path

    if reason := require_root():
        raise SystemExit(reason)
    model = str(default_model_path())
    with tempfile.TemporaryDirectory() as home, Testbed(2, docker=True) as bed:
        env = {**os.environ, "LLMCTL_KNOWN_HOSTS": f"{home}/known_hosts", "COLUMNS": "200"}
        build_images(bed)
        results = {layout: measure(layout, bed, model, args, env) for layout in layouts}

    report(args, results)


def report(args, results: dict[str, dict]) -> None:
    env = f", env {args.node_env}" if args.node_env else ""
    print(
        f"\npp=2 on test-bed hosts, {args.requests} requests at concurrency {args.concurrency}, "
        f"{args.prompt_len} prompt + {args.output_len} output tokens{env}"
    )
    rows = [
        ("cluster up (s)", "up_s", "{:.1f}"),
        ("up -> /health (s)", "healthy_s", "{:.1f}"),
        ("up -> first token (s)", "first_token_s", "{:.1f}"),
        ("requests/s", "req_per_s", "{:.2f}"),
        ("output tokens/s", "tok_per_s", "{:.1f}"),
        ("TTFT p50 (s)", "ttft_p50", "{:.3f}"),
        ("ITL p50 (s)", "itl_p50", "{:.4f}"),
    ]
    names = list(results)
    ratios = [(a, b) for a, b in (("mp", "ray"), ("ray", "one host"), ("mp", "one host"))
              if a in results and b in results]  # fmt: skip
    print(f"{'':24}" + "".join(f"{name:>10}" for name in names)
          + "".join(f"{a + ' / ' + b:>16}" for a, b in ratios))  # fmt: skip
    for label, key, fmt in rows:
        values = "".join(f"{fmt.format(results[name][key]):>10}" for name in names)
        shares = "".join(f"{results[a][key] / results[b][key]:>15.2f}x" for a, b in ratios)
        print(f"{label:24}{values}{shares}")


if __name__ == "__main__":
    main()
