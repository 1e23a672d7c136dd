"""Offline throughput: llmctl vs Hugging Face transformers' batched generate, same model, one run.

Workload (issue #2): 64 prompts of 32 random token ids, 128 greedy output tokens each, EOS
ignored; and a single stream (1 prompt, 128 tokens). Both engines get the same token ids and the
same weights (the bundled SmolLM2-135M GGUF, dequantized). Each run is a fresh process, after a
short warm-up, so none inherits another's allocator or thread state.

Runs: llmctl with its default dtype ("auto": bfloat16 on CPUs with AVX512-BF16, else float32),
llmctl in float32, and transformers in float32 (its default for this model) and in bfloat16, so
ratios are shown both default-to-default and at equal dtype.

    python benchmarks/throughput.py            # both workloads
    python benchmarks/throughput.py --batch 64 --output-len 128 --repeats 3
    python benchmarks/throughput.py --device cuda     # both engines on the GPU

llmctl's line also shows the time its model runner spends preparing a step's inputs (gathering
token ids, positions, slot mapping, block tables and sampling tensors and copying them to the
device), per step, out of the whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def make_prompts(batch: int, prompt_len: int, vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # Skip the first ids (special tokens) so no prompt holds an EOS or chat marker.
    return torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist()


def _time_prepare(runner) -> dict:
    """Accumulate the seconds the runner spends in _prepare_inputs, and its step count."""
    spent = {"seconds": 0.0, "steps": 0}
    prepare = runner._prepare_inputs

    def timed(scheduler_output):
        start = time.perf_counter()
        try:
            return prepare(scheduler_output)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["steps"] += 1

    runner._prepare_inputs = timed
    return spent


def run_llmctl(
    prompts: list[list[int]],
    output_len: int,
    repeats: int,
    dtype: str,
    device: str,
    model: str | None = None,
    **engine_kwargs,
) -> dict:
    """Best-of-`repeats` offline generation with llmctl's LLM (model None: the bundled one)."""
    from llmctl.engine import LLM, SamplingParams

    llm = LLM(model, use_tqdm_on_load=False, dtype=dtype, device=device, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params.replace(max_tokens=4), use_tqdm=False)  # warm-up
    times, outputs, prepare = [], None, None
    for _ in range(repeats):
        llm.llm_engine.scheduler.block_manager.reset_prefix_cache()  # no reuse between repeats
        prepare = _time_prepare(llm.llm_engine.executor.worker.model_runner)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": min(times),
        "tokens": tokens,
        "first_ids": outputs[0].outputs[0].token_ids,
        "ids": [o.outputs[0].token_ids for o in outputs],
        "dtype": llm.llm_engine.config.model_config.dtype,
        "prepare_ms_per_step": 1000 * prepare["seconds"] / max(prepare["steps"], 1),
        "ms_per_step": 1000 * times[-1] / max(prepare["steps"], 1),
    }


def run_transformers(
    prompts: list[list[int]],
    output_len: int,
    repeats: int,
    dtype: str,
    device: str,
    model: str | None = None,
) -> dict:
    """Best-of-`repeats` batched greedy `generate` (model None: the bundled GGUF, dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmctl.engine.model_loader.default_model import default_model_path

    if model is None:
        gguf = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        model = AutoModelForCausalLM.from_pretrained(model)
    model = model.eval()
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    if device != "cpu":
        model = model.to(device)
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def generate(input_ids, attention_mask, n):
        with torch.inference_mode():
            return model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    generate(ids[:2], mask[:2], 4)  # warm-up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(ids, mask, output_len)
        times.append(time.perf_counter() - start)
    new = out[:, ids.shape[1] :]
    return {
        "seconds": min(times),
        "tokens": new.numel(),
        "first_ids": new[0].tolist(),
        "ids": new.tolist(),
        "dtype": str(model.dtype).removeprefix("torch."),
    }


RUNS = [
    ("llmctl", "auto"),
    ("llmctl", "float32"),
    ("transformers", "auto"),
    ("transformers", "bfloat16"),
]


CHILD_FLAGS = ("batch", "prompt_len", "output_len", "repeats", "device")


def run_child(
    engine: str, dtype: str, args, script: str = __file__, flags: tuple[str, ...] = CHILD_FLAGS
) -> dict:
    """Run `script --child ENGINE --dtype DTYPE --FLAG args.FLAG ...` in a fresh process and
    return the JSON dict it prints last."""
    cmd = [sys.executable, script, "--child", engine, "--dtype", dtype]
    for flag in flags:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        raise SystemExit(f"{engine} ({dtype}) benchmark failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(args) -> None:
    print(f"\n{args.batch} x {args.prompt_len}-token prompts -> {args.output_len} tokens each")
    results, rate = {}, {}
    for engine, dtype in RUNS:  # each line as its run ends
        r = results[(engine, dtype)] = run_child(engine, dtype, args)
        rate[(engine, dtype)] = r["tokens"] / r["seconds"]
        label = f"{engine} ({'default, ' if dtype == 'auto' else ''}{r['dtype']})"
        line = f"  {label:34s} {r['seconds']:8.2f} s  {rate[(engine, dtype)]:8.1f} output tok/s"
        if "prepare_ms_per_step" in r:
            line += (
                f"  (inputs {r['prepare_ms_per_step']:.3f} ms of {r['ms_per_step']:.1f} ms"
                " per step)"
            )
        print(line, flush=True)
    ours, theirs = results[("llmctl", "auto")], results[("transformers", "auto")]

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        return f"{rate[a] / rate[b]:.2f}x"

    lines = [
        ("defaults", ("llmctl", "auto"), ("transformers", "auto")),
        ("float32 both", ("llmctl", "float32"), ("transformers", "auto")),
    ]
    if ours["dtype"] == "bfloat16":
        lines.append(("bfloat16 both", ("llmctl", "auto"), ("transformers", "bfloat16")))
    for name, a, b in lines:
        print(f"  ratio llmctl / transformers, {name + ':':15s} {ratio(a, b)}")
    same = results[("llmctl", "float32")]["first_ids"] == theirs["first_ids"]
    print(f"  float32 outputs identical (first sequence): {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--child", choices=["llmctl", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prompts = make_prompts(args.batch, args.prompt_len)
        run = run_llmctl if args.child == "llmctl" else run_transformers
        print(json.dumps(run(prompts, args.output_len, args.repeats, args.dtype, args.device)))
        return
    batches = [args.batch] if args.batch else [64, 1]
    for batch in batches:
        compare(argparse.Namespace(**{**vars(args), "batch": batch}))


if __name__ == "__main__":
    main()
