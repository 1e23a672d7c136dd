"""llmctl vs llama.cpp on the same GGUF file and the same token ids, one run (issue 15).

Workloads, greedy, EOS ignored, each engine in its own fresh process:
    W1  1 prompt x 32 token ids -> 128 tokens   (single-stream decode; output tok/s)
    W2  64 prompts x 32 -> 128 tokens            (batched decode; output tok/s)
    W3  16 prompts x 512 -> 1 token              (prefill; prompt tok/s)
    start-up: process start to the first token, cold (llmctl: an empty LLMCTL_CACHE_DIR, so the
    first run after install: GGUF conversion, kernel build) and warm; peak RSS after W1 (start-up
    + single stream).
Each side runs with its own defaults and again with 2 threads (OMP_NUM_THREADS=2 for llmctl and
transformers; n_threads = n_threads_batch = 2 for llama.cpp). llmctl is driven through its public
API only, LLM(model=path_to_gguf), so it measures whichever GGUF path the tree has. llama.cpp is
driven through llama-cpp-python's low-level API (llama_batch + llama_decode with one sequence id per
prompt, a unified KV cache, greedy argmax on its logits): its batched API.

The GGUF section also runs Hugging Face transformers on the same weights dequantized (a Hugging
Face directory written once by transformers, cached) in float32 and in bfloat16, and prints
llmctl's ratio to the best peer of each workload (the fastest of llama.cpp and transformers in
either dtype): issue 35's goals are W1 >= 1.2x llama.cpp, W2 and W3 >= 2x the best peer.
The float path is compared the same way: llmctl as LLM(model=that_dir) against transformers.

    python benchmarks/gguf_vs_llamacpp.py --setup     # once: builds llama-cpp-python (minutes)
    python benchmarks/gguf_vs_llamacpp.py             # everything (bundled SmolLM2 Q4_1)
    python benchmarks/gguf_vs_llamacpp.py --gguf model.gguf --workloads W1 --threads 2 --no-float

--setup builds llama-cpp-python from source with CMAKE_ARGS derived from this CPU's flags
(`llamacpp_cmake_args`, printed): GGML_NATIVE=OFF and each x86 extension the CPU has turned on
by name, AMX off. A native build turns AMX_INT8 on where the CPU has it, and 0.3.36 built so
crashes in its first llama_decode on the Intel AMX kind of this project's machine; with AMX off it
runs there with AVX-512, VNNI and BF16. LLMCTL_CPU_FLAGS_OFF (flags treated as absent) gives an
older CPU's build, e.g. `LLMCTL_CPU_FLAGS_OFF='avx512*,amx*'` an AVX2-only one.

--interleave N: llmctl and each peer in turn (llama.cpp, transformers in float32, in bfloat16)
stay up (one process each) and take turns, N rounds per workload, the order swapped every
round; the table gives each engine's median (llmctl's over the rounds against every peer) and
each ratio is the median of that pair's rounds' ratios. On a VM whose speed drifts by 10-30% from
one minute to the next (this project's build machine), sequential runs compare different
machines; alternating rounds compare the engines under the same conditions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = {"W1": (1, 32, 128), "W2": (64, 32, 128), "W3": (16, 512, 1)}  # batch, prompt, out
TRANSFORMERS_DTYPES = {"transformers": "float32", "transformers-bf16": "bfloat16"}
GOALS = {"W1": ("llamacpp", 1.2), "W2": (None, 2.0), "W3": (None, 2.0)}  # None: the best peer
REQUIREMENTS = HERE / "requirements-llamacpp.txt"


# -- children: one engine each ------------------------------------------------------------------


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class LlmctlRunner:
    def __init__(self, model: str) -> None:
        from llmctl.engine import LLM, SamplingParams

        self.llm = LLM(model=model, use_tqdm_on_load=False)
        self.params = SamplingParams(temperature=0, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        self.llm.llm_engine.scheduler.block_manager.reset_prefix_cache()  # no reuse between runs
        params = self.params.replace(max_tokens=max_tokens)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


class TransformersRunner:
    def __init__(self, model: str, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model.eval()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = self.torch.tensor(prompts)
        with self.torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()


class LlamaCppRunner:
    """llama.cpp's batched decoding: every live sequence's token in one llama_batch per step."""

    def __init__(self, model: str, threads: int | None) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(model.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp cannot load {model}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        # llama-cpp-python's Llama() defaults: half the cores decode, all of them prefill
        cores = os.cpu_count() or 1
        self.n_threads = threads or max(cores // 2, 1)
        self.n_threads_batch = threads or cores
        self.n_batch = 2048
        self.ctx, self.ctx_key = None, None

    def _context(self, num_seqs: int, tokens_per_seq: int):
        L = self.L
        key = (num_seqs, tokens_per_seq)
        if self.ctx_key != key:
            if self.ctx is not None:
                L.llama_free(self.ctx)
            params = L.llama_context_default_params()
            params.n_ctx = -(-num_seqs * tokens_per_seq // 256) * 256
            params.n_batch = self.n_batch
            params.n_seq_max = num_seqs
            params.kv_unified = True  # sequences share the cache, as llmctl's paged blocks do
            params.n_threads, params.n_threads_batch = self.n_threads, self.n_threads_batch
            self.ctx, self.ctx_key = L.llama_init_from_model(self.model, params), key
            self.batch = L.llama_batch_init(max(self.n_batch, num_seqs), 0, 1)
        return self.ctx

    def _decode(self, ctx, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (seq, pos, token, wants_logits); returns the greedy token of each logits row."""
        import numpy as np

        L, b = self.L, self.batch
        for i, (seq, pos, token, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if L.llama_decode(ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        rows = [i for i, item in enumerate(items) if item[3]]
        shape = (self.n_vocab,)
        return [
            int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=shape).argmax())
            for i in rows
        ]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        L = self.L
        ctx = self._context(len(prompts), len(prompts[0]) + max_tokens)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        items = [
            (s, pos, tok, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        last = []
        for start in range(0, len(items), self.n_batch):
            last += self._decode(ctx, items[start : start + self.n_batch])
        outputs = [[t] for t in last]
        for step in range(1, max_tokens):
            steps = [(s, len(p) + step - 1, outputs[s][-1], True) for s, p in enumerate(prompts)]
            for s, token in enumerate(self._decode(ctx, steps)):
                outputs[s].append(token)
        return outputs


def child(args) -> dict:
    spawned = float(os.environ["BENCH_SPAWNED_AT"])
    spec = json.loads(Path(args.spec).read_text())
    threads = None if args.threads == "default" else int(args.threads)
    if args.child == "llmctl":
        runner = LlmctlRunner(spec["model"])
    elif args.child.startswith("transformers"):
        runner = TransformersRunner(spec["float_model"], TRANSFORMERS_DTYPES[args.child])
    else:
        runner = LlamaCppRunner(spec["model"], threads)
    first = runner.generate([spec["prompts"]["W1"][0]], 1)
    result = {"start_s": time.time() - spawned, "first": first[0]}
    if args.start_only:
        return result
    if args.serve:  # one line per workload name on stdin: run it once, answer with its time
        print(json.dumps(result), flush=True)
        for line in sys.stdin:
            name = line.strip()
            prompts, out_len = spec["prompts"][name], WORKLOADS[name][2]
            start = time.perf_counter()
            outputs = runner.generate(prompts, out_len)
            took = time.perf_counter() - start
            reply = {"seconds": took, "first_ids": outputs[0], "rss_mb": _peak_rss_mb()}
            print(json.dumps(reply), flush=True)
        return {"rss_mb": _peak_rss_mb()}
    for name in spec["workloads"]:
        prompts, out_len = spec["prompts"][name], WORKLOADS[name][2]
        times = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            outputs = runner.generate(prompts, out_len)
            times.append(time.perf_counter() - start)
        tokens = len(prompts) * len(prompts[0]) if name == "W3" else sum(map(len, outputs))
        result[name] = {"tok_s": tokens / min(times), "first_ids": outputs[0]}
        if name == "W1":
            result["rss_w1_mb"] = _peak_rss_mb()
    result["rss_mb"] = _peak_rss_mb()
    return result


# -- the parent: set-up, runs, table ------------------------------------------------------------


def run_child(engine: str, threads: str, spec_path: Path, env_extra=None, start_only=False) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--threads", threads]
    cmd += ["--spec", str(spec_path)] + (["--start-only"] if start_only else [])
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    env["BENCH_SPAWNED_AT"] = repr(time.time())
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{engine} (threads {threads}) failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


class ServingChild:
    """One engine kept up by `--child E --serve`: run(workload) -> seconds, first ids, RSS."""

    def __init__(self, engine: str, threads: str, spec_path: Path) -> None:
        cmd = [sys.executable, __file__, "--child", engine, "--threads", threads, "--serve"]
        cmd += ["--spec", str(spec_path)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if threads != "default":
            env["OMP_NUM_THREADS"] = threads
        env["BENCH_SPAWNED_AT"] = repr(time.time())
        self.engine = engine
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.start = self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.engine} exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def interleaved(engines: tuple[str, str], threads: str, spec_path: Path, workloads, rounds: int):
    """Rows as run_child gives them, from `rounds` alternating runs per workload: each engine's
    median tok/s and its "rates" (every round's), and "ratio_to": {engines[1]: the median of the
    rounds' ratios (engines[0] / engines[1])}."""
    children = [ServingChild(e, threads, spec_path) for e in engines]
    rows = {e: {"start_s": c.start["start_s"]} for e, c in zip(engines, children, strict=True)}
    try:
        for name in workloads:
            batch, prompt_len, out_len = WORKLOADS[name]
            tokens = batch * prompt_len if name == "W3" else batch * out_len
            rates: dict[str, list[float]] = {e: [] for e in engines}
            for i in range(rounds):
                for child in children if i % 2 == 0 else children[::-1]:
                    reply = child.run(name)
                    rates[child.engine].append(tokens / reply["seconds"])
                    rows[child.engine][name] = {"first_ids": reply["first_ids"]}
                    if name == "W1":
                        rows[child.engine]["rss_w1_mb"] = reply["rss_mb"]
                a, b = (rates[e][-1] for e in engines)
                print(f"    {name} round {i + 1}: {engines[0]} {a:.1f}, {engines[1]} {b:.1f} "
                      f"tok/s ({a / b:.2f}x)", file=sys.stderr, flush=True)  # fmt: skip
            ratios = [a / b for a, b in zip(rates[engines[0]], rates[engines[1]], strict=True)]
            for e in engines:
                rows[e][name]["tok_s"] = statistics.median(rates[e])
                rows[e][name]["rates"] = rates[e]
            # the median of the rounds' ratios: to this peer only, not to the others
            rows[engines[0]][name]["ratio_to"] = {engines[1]: statistics.median(ratios)}
    finally:
        for child in children:
            child.close()
    return rows


def make_prompts(vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # ids from 100 up: no special tokens (EOS, chat markers) inside a prompt
    return {
        name: rng.integers(100, vocab, (batch, plen)).tolist()
        for name, (batch, plen, _) in WORKLOADS.items()
    }


def gguf_vocab_size(path: Path) -> int:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return len(field.data)


def float_directory(gguf: Path) -> Path:
    """The GGUF dequantized into a Hugging Face directory by transformers (cached)."""
    root = Path(os.environ.get("LLMCTL_CACHE_DIR") or Path.home() / ".cache" / "llmctl")
    out = root / "bench" / f"{gguf.stem}-float32"
    if not (out / "model.safetensors").exists():
        print(f"writing the dequantized float32 weights to {out} (once)", file=sys.stderr)
        # save_pretrained refuses a model loaded from GGUF; its weights are plain float tensors
        code = (
            "import sys, os; from transformers import AutoModelForCausalLM, AutoTokenizer;"
            "from safetensors.torch import save_model; g, n, o = sys.argv[1:];"
            "m = AutoModelForCausalLM.from_pretrained(g, gguf_file=n); os.makedirs(o);"
            "m.config.__dict__.pop('quantization_config', None);"
            "m.config.architectures = [type(m).__name__]; m.config.save_pretrained(o);"
            "m.generation_config.save_pretrained(o);"
            "save_model(m, os.path.join(o, 'model.safetensors'), metadata={'format': 'pt'});"
            "AutoTokenizer.from_pretrained(g, gguf_file=n).save_pretrained(o)"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(gguf.parent), gguf.name, str(out)], check=True
        )
    return out


def first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first differs at token {i}"
    return "identical"


def _fmt(value, unit="") -> str:
    return "-" if value is None else f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"


def _ratio(ours: dict, theirs: dict, peer: str) -> float:
    """Our workload result over the peer's: the median of the interleaved rounds' ratios where
    the two took turns, else the ratio of their tok/s."""
    return ours.get("ratio_to", {}).get(peer, ours["tok_s"] / theirs["tok_s"])


def print_table(title: str, rows: dict, pairs: list[tuple[str, str]], workloads) -> None:
    print(f"\n{title}")
    head = ["engine", "threads", "start cold s", "start warm s"]
    head += [f"{w} tok/s" for w in workloads] + ["peak RSS W1 MB"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (engine, threads), r in rows.items():
        cells = [engine, threads, _fmt(r.get("cold_s")), _fmt(r["start_s"])]
        cells += [_fmt(r[w]["tok_s"]) for w in workloads] + [_fmt(r.get("rss_w1_mb"))]
        print("| " + " | ".join(cells) + " |")
    for ours, theirs in pairs:
        for threads in sorted({t for _, t in rows}):
            a, b = rows.get((ours, threads)), rows.get((theirs, threads))
            if not a or not b:
                continue
            ratios = []
            for w in workloads:
                ratio = _ratio(a[w], b[w], theirs)
                ratios.append(f"{w} {ratio:.2f}x")
            ratios.append(f"warm start {a['start_s'] / b['start_s']:.1f}x as long")
            if "rss_w1_mb" in a:
                ratios.append(f"RSS {a['rss_w1_mb'] / b['rss_w1_mb']:.1f}x")
            print(f"  {ours} / {theirs}, threads {threads}: " + ", ".join(ratios))
            if "W1" in workloads:
                same = first_difference(a["W1"]["first_ids"], b["W1"]["first_ids"])
                print(f"    W1 greedy tokens: {same}")


def print_best_peer(rows: dict, ours: str, peers: list[str], workloads) -> None:
    """llmctl's ratio to the fastest peer of each workload, and to issue 35's goal."""
    for threads in sorted({t for _, t in rows}):
        a = rows.get((ours, threads))
        present = [p for p in peers if (p, threads) in rows]
        if not a or not present:
            continue
        parts = []
        for w in workloads:
            best = max(present, key=lambda p: rows[(p, threads)][w]["tok_s"])
            ratio = _ratio(a[w], rows[(best, threads)][w], best)
            goal_peer, goal = GOALS[w]
            if goal_peer is not None and goal_peer in present:
                goal_ratio = _ratio(a[w], rows[(goal_peer, threads)][w], goal_peer)
                verdict = f"{goal_ratio:.2f}x {goal_peer}, goal {goal}x"
            else:
                verdict = f"goal {goal}x"
            parts.append(f"{w} {ratio:.2f}x {best} ({verdict})")
        print(f"  {ours} / best peer, threads {threads}: " + "; ".join(parts))


def llamacpp_cmake_args(flags: set[str]) -> list[str]:
    """CMAKE_ARGS for a llama.cpp build that runs on a CPU with `flags` (/proc/cpuinfo names):
    no -march=native, each extension it has by name, AMX off (see the module doc)."""
    options = {
        "GGML_AVX": "avx",
        "GGML_AVX2": "avx2",
        "GGML_FMA": "fma",
        "GGML_F16C": "f16c",
        "GGML_BMI2": "bmi2",
        "GGML_AVX_VNNI": "avx_vnni",
        "GGML_AVX512": "avx512f",
        "GGML_AVX512_VBMI": "avx512vbmi",
        "GGML_AVX512_VNNI": "avx512_vnni",
        "GGML_AVX512_BF16": "avx512_bf16",
    }
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in options.items()]
    return args + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def setup() -> None:
    from llmctl.engine.platform import cpu_flags

    cmake_args = " ".join(llamacpp_cmake_args(cpu_flags()))
    env = {**os.environ, "CMAKE_ARGS": cmake_args}
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "--no-binary",
        "llama-cpp-python",
    ]
    install = [*pip, "-r", str(REQUIREMENTS)]
    if importlib.util.find_spec("llama_cpp") is not None:
        # rebuilt even when a (native, crashing) build is installed; its dependencies kept
        install = [*pip, "--force-reinstall", "--no-deps", "-r", str(REQUIREMENTS)]
    print(f"building llama-cpp-python from source (several minutes):\n  CMAKE_ARGS={cmake_args!r}")
    print("  " + " ".join(install))
    subprocess.run(install, check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="install llama-cpp-python, then exit")
    parser.add_argument("--gguf", type=Path, help="default: the bundled SmolLM2-135M Q4_1")
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--threads", default="default,2", help="comma list: default and/or N")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-cold", action="store_true", help="skip the cold start-up runs")
    parser.add_argument("--no-float", action="store_true", help="skip llmctl float vs transformers")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llmctl vs llama.cpp")
    parser.add_argument(
        "--no-peers", action="store_true", help="GGUF section: llama.cpp only, no transformers"
    )
    parser.add_argument(
        "--interleave", type=int, default=0, metavar="N",
        help="llmctl vs llama.cpp: both engines up, N alternating rounds per workload",
    )  # fmt: skip
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--child", choices=["llmctl", "llamacpp", *TRANSFORMERS_DTYPES], help=argparse.SUPPRESS
    )
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.setup:
        setup()
        return
    if args.gguf is None:
        from llmctl.engine.model_loader.default_model import default_model_path

        args.gguf = default_model_path()
    gguf = args.gguf.resolve()
    workloads = [w.strip() for w in args.workloads.split(",")]
    threads = [t.strip() for t in args.threads.split(",")]
    prompts = make_prompts(gguf_vocab_size(gguf))
    print(f"{gguf.name}; workloads {', '.join(f'{w} {WORKLOADS[w]}' for w in workloads)}")
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = float_directory(gguf) if not (args.no_float and args.no_peers) else None

        def spec(model: Path) -> Path:
            path = Path(tmp) / f"spec-{abs(hash(str(model)))}.json"
            body = {"model": str(model), "float_model": str(float_dir), "prompts": prompts}
            path.write_text(json.dumps({**body, "workloads": workloads, "repeats": args.repeats}))
            return path

        transformers = [] if args.no_peers else list(TRANSFORMERS_DTYPES)
        sections = []
        if not args.no_llamacpp:
            title = "GGUF: llmctl LLM(model=gguf) vs llama.cpp and transformers"
            sections.append((title, gguf, ["llamacpp", *transformers]))
        if not args.no_float:
            title = "Float path: llmctl LLM(model=dequantized dir) vs transformers"
            sections.append((title, float_dir, list(TRANSFORMERS_DTYPES)))
        known: dict = {}  # transformers' rows, the same runs in both sections
        for title, model, peers in sections:
            rows = run_section(args, spec(model), workloads, threads, peers, known)
            print_table(title, rows, [("llmctl", p) for p in peers], workloads)
            print_best_peer(rows, "llmctl", peers, workloads)


def merge_llmctl_rows(pairs: list[dict], workloads) -> dict:
    """llmctl's row from its interleaved runs against several peers: per workload the median of
    all its rounds, and its ratio to each peer from that pair's rounds."""
    merged = {**pairs[0]}
    for w in workloads:
        rates = [r for pair in pairs for r in pair[w]["rates"]]
        ratio_to = {p: x for pair in pairs for p, x in pair[w]["ratio_to"].items()}
        merged[w] = {**pairs[0][w], "tok_s": statistics.median(rates), "rates": rates,
                     "ratio_to": ratio_to}  # fmt: skip
    return merged


def run_section(args, path: Path, workloads, threads, peers: list[str], known: dict) -> dict:
    """{(engine, threads): results} for llmctl and its peers on one spec; `known`: transformers'
    rows of an earlier section (the same weights and prompts), reused and filled."""
    if not args.interleave:
        rows = {k: r for k, r in known.items() if k[0] in peers}
    else:  # every peer in turns with llmctl, here: no row of an earlier section
        rows = {}
        for t in threads:
            pairs = []
            for peer in peers:
                print(f"  llmctl and {peer} in turns, threads {t} ...", file=sys.stderr, flush=True)
                pair = interleaved(("llmctl", peer), t, path, workloads, args.interleave)
                rows[(peer, t)] = pair[peer]
                pairs.append(pair["llmctl"])
            rows[("llmctl", t)] = merge_llmctl_rows(pairs, workloads)
    for engine in ("llmctl", *peers):
        for t in threads:
            if (engine, t) in rows:
                continue
            print(f"  running {engine}, threads {t} ...", file=sys.stderr, flush=True)
            rows[(engine, t)] = r = run_child(engine, t, path)
            if engine in TRANSFORMERS_DTYPES:
                known[(engine, t)] = r
            done = ", ".join(f"{w} {r[w]['tok_s']:.1f} tok/s" for w in workloads)
            print(f"    start {r['start_s']:.1f} s, {done}", file=sys.stderr, flush=True)
    if not args.no_cold and "llamacpp" in peers:
        for engine in ("llmctl", "llamacpp"):
            with tempfile.TemporaryDirectory() as cache:
                env = {"LLMCTL_CACHE_DIR": cache}
                cold = run_child(engine, threads[0], path, env, start_only=True)
            rows[(engine, threads[0])]["cold_s"] = cold["start_s"]
    order = ["llmctl", *peers]
    rank = {key: (order.index(key[0]), threads.index(key[1])) for key in rows}
    return dict(sorted(rows.items(), key=lambda item: rank[item[0]]))


if __name__ == "__main__":
    main()
