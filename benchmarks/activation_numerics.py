"""How far each CPU path's activation numerics move the bundled model from float32.

    python benchmarks/activation_numerics.py [--max-tokens 1024]

The bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantized by transformers, teacher-forced
over a fixed text (this repository's docs/architecture.md and README.md, and four chat turns in
the model's template), one forward pass per text. Against float32 activations on those weights,
each row of the table gives, over every position: how often its top token is float32's, and the
KL divergence of its next-token distribution from float32's (mean, 95th percentile, largest).

    bfloat16          weights and activations in bfloat16: dtype "auto" on CPUs with
                      AVX512-BF16 or AMX (the float path)
    int8 activations  every layer's linear input quantized per 32 values to int8 (s = amax /
                      127, round to nearest even), as int8_gemm.cpp quantizes it on the AVX2 and
                      Zen 4 paths; the LM head's input kept float (it stays float there)
    int8, LM head too the same with the LM head's input quantized as well (what the engines do
                      not do)
    llama.cpp         llama-cpp-python on the same GGUF (its own int8 activations at every
                      linear, the LM head included), where it is installed

The int8 rows simulate the kernels' rule in torch; the kernels themselves are held to that rule
by tests/kernels/test_int8_gemm.py (a float64 reference of the quantized activations).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
CHATS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "What is the boiling point of water?",
)


def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """x with each run of 32 values along the last dim replaced by s * round(x / s), s = amax /
    127 (0 where amax is 0): the int8 kernels' activations as they multiply them."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * (amax / 127)).reshape(x.shape)


def texts(tokenizer) -> list[str]:
    out = [
        (ROOT / "docs" / "architecture.md").read_text()[:6000],
        (ROOT / "README.md").read_text()[:4000],
    ]
    answer = "I will answer carefully and in detail. " * 3
    for question in CHATS:
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(tokenizer.apply_chat_template(turns, tokenize=False))
    return out


@torch.inference_mode()
def hf_logits(model, ids: list[list[int]], mode: str) -> torch.Tensor:
    """Every position's logits (float32) for `mode`: float32, int8, int8+head, or bfloat16
    (which leaves the model in bfloat16)."""
    plain = torch.nn.Linear.forward
    vocab = model.config.vocab_size

    def int8_forward(layer, x):
        if layer.in_features % 32 == 0 and (mode == "int8+head" or layer.out_features != vocab):
            x = quantize_blocks(x)
        return plain(layer, x)

    if mode == "bfloat16":
        model.to(torch.bfloat16)  # for good: the weights' float32 values are gone after this
    if mode.startswith("int8"):
        torch.nn.Linear.forward = int8_forward
    try:
        return torch.cat([model(torch.tensor([row])).logits[0].float() for row in ids])
    finally:
        torch.nn.Linear.forward = plain


def llama_cpp_logits(gguf: Path, ids: list[list[int]]) -> torch.Tensor | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    longest = max(len(row) for row in ids)
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=longest + 8, n_batch=longest, n_threads=2,
        logits_all=True, verbose=False,
    )  # fmt: skip
    out = []
    for row in ids:
        llm.reset()
        llm.eval(row)
        out.append(torch.tensor(llm.scores[: len(row)], dtype=torch.float32))
    return torch.cat(out)


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    ref_lp, lp = F.log_softmax(reference, -1), F.log_softmax(logits, -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    return {
        "top1": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_p95": kl.quantile(0.95).item(),
        "kl_max": kl.max().item(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens a text at most")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmctl.engine.model_loader.default_model import default_model_path

    gguf = default_model_path()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = [tokenizer(t).input_ids[: args.max_tokens] for t in texts(tokenizer)]
    reference = hf_logits(model, ids, "float32")
    rows = {
        "int8 activations": hf_logits(model, ids, "int8"),
        "int8, LM head too": hf_logits(model, ids, "int8+head"),
        "bfloat16": hf_logits(model, ids, "bfloat16"),  # last: it rounds the weights
    }
    peer = llama_cpp_logits(gguf, ids)
    if peer is not None:
        rows["llama.cpp (Q4_1)"] = peer
    print(f"{reference.shape[0]} positions, against float32 activations on the same weights")
    print("| activations | top token = float32's | mean KL | p95 KL | max KL |")
    print("|---|---|---|---|---|")
    for name, logits in rows.items():
        c = compare(reference, logits)
        print(
            f"| {name} | {100 * c['top1']:.2f}% | {c['kl_mean']:.4f} | {c['kl_p95']:.4f} "
            f"| {c['kl_max']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
