"""Mixture-of-experts offline throughput: llmctl `LLM.generate` vs transformers `generate`.

A random MoE model (Mixtral, Qwen2-MoE with its shared expert, or Qwen3-MoE; hidden 512,
8 experts of 1024 features, top-2, 4 layers by default) is built once from a seeded config and
saved as safetensors, as the tests build theirs; both engines load those same weights in
float32. Workload: a single stream and a batch of 16 (`--batches`), prompts of 32 random token
ids, 64 greedy output tokens each, EOS ignored. Each run is a fresh process after a short
warm-up (benchmarks/throughput.py's run_llmctl / run_transformers). Prints output tokens/s of
both, the ratio, and whether every sequence's tokens agree.

    python benchmarks/moe_vs_transformers.py                     # mixtral, batch 1 and 16
    python benchmarks/moe_vs_transformers.py --family qwen2-moe --layers 8 --repeats 2
    python benchmarks/moe_vs_transformers.py --family all
    python benchmarks/moe_vs_transformers.py --threads 1    # both engines on one core

On a shared machine a busy core stalls every parallel region of a 2-thread run (oneDNN's more
than MKL's), so `--threads 1` gives the steadier per-core comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from throughput import CHILD_FLAGS, make_prompts, run_child, run_llmctl, run_transformers  # noqa: E402

FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")
VOCAB = 32000


def moe_config(family: str, args):
    """The Hugging Face config of a random `family` model of the benchmark's size."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=1024,
        num_experts_per_tok=args.top_k,
    )
    if family == "mixtral":
        return MixtralConfig(
            **common, intermediate_size=args.expert_size, num_local_experts=args.experts
        )
    if family == "qwen2-moe":  # a shared expert of 2x an expert's features, gated
        return Qwen2MoeConfig(
            **common,
            moe_intermediate_size=args.expert_size,
            shared_expert_intermediate_size=2 * args.expert_size,
            num_experts=args.experts,
        )
    return Qwen3MoeConfig(  # q/k norm, renormalized top-k
        **common, moe_intermediate_size=args.expert_size, num_experts=args.experts
    )


def save_model(family: str, args, root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(family, args)).eval()
    path = root / family
    model.save_pretrained(path)
    return path


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """'16/16 sequences identical', or how many and where the first difference is."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    text = f"{same}/{len(ours)} sequences identical"
    for n, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            step = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            text += f" (sequence {n} first differs at output token {step})"
            break
    return text


def compare(family: str, path: Path, args) -> float:
    """Print one family's lines; return the batch-16 (largest batch) ratio."""
    print(f"\n{family}: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of "
          f"{args.expert_size} features, top-{args.top_k}, float32, "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')} threads; prompts of "
          f"{args.prompt_len} ids -> {args.output_len} tokens")  # fmt: skip
    ratio = 0.0
    for batch in args.batches:
        run = argparse.Namespace(**{**vars(args), "batch": batch, "model": str(path)})
        results = {
            engine: run_child(engine, "float32", run, __file__, CHILD_FLAGS + ("model",))
            for engine in ("llmctl", "transformers")
        }
        rate = {e: r["tokens"] / r["seconds"] for e, r in results.items()}
        ratio = rate["llmctl"] / rate["transformers"]
        ours = results["llmctl"]
        print(f"  batch {batch:3d}: llmctl {rate['llmctl']:8.1f} tok/s "
              f"({ours['ms_per_step']:.1f} ms/step), transformers "
              f"{rate['transformers']:8.1f} tok/s, ratio {ratio:.2f}x; "
              f"{agreement(ours['ids'], results['transformers']['ids'])}")  # fmt: skip
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="mixtral")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads of both engines")
    parser.add_argument("--child", choices=["llmctl", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prompts = make_prompts(args.batch, args.prompt_len, vocab=VOCAB)
        common = (prompts, args.output_len, args.repeats, args.dtype, args.device, args.model)
        if args.child == "llmctl":
            result = run_llmctl(*common, skip_tokenizer_init=True)
        else:
            result = run_transformers(*common)
        print(json.dumps(result))
        return
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children inherit it
    families = FAMILIES if args.family == "all" else (args.family,)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as root:
        for family in families:
            compare(family, save_model(family, args, Path(root)), args)


if __name__ == "__main__":
    main()
