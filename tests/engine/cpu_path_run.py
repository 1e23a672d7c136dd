"""One CPU code path on the bundled model, in its own process (test_cpu_paths.py starts it with the
environment that selects the path): greedy tokens and top-5 logprobs of the native quantized
weights (dtype "auto", which the path decides) and of the float path on the same weights
dequantized, in that dtype. Prints one JSON object.

The prompts reach each kernel of the path: a batch of 8 (a prefill of ~90 rows and decode steps
of 8 rows: the batched matmul, bfloat16 tiles on the AMX and AVX512-BF16 paths), two together
(decode steps of 2 rows: the decode kernels) and a 520-token prompt (a prefill of 512 rows or
more: the prefill GEMM, AMX tiles, int8 activations or weights expanded in chunks; the JSON's
"prefill" says which: "int8" on the AVX2 path too, whose prefill batches on 4-bit weights take
int8 activations).
"""

from __future__ import annotations

import json
import logging

import torch

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.kernels.cpu import quantized_matmul
from llmctl.engine.platform import cpu_path

TEXT = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
COMMON = dict(use_tqdm_on_load=False, kv_cache_space_gib=0.1, max_model_len=1024)


def prompts() -> list[list]:
    g = torch.Generator().manual_seed(0)
    ids = [
        {"prompt_token_ids": torch.randint(100, 49152, (n,), generator=g).tolist()}
        for n in (5, 9, 17, 30, 3, 12, 7, 21, 40)
    ]
    long = [{"prompt_token_ids": torch.randint(100, 49152, (520,), generator=g).tolist()}]
    return [TEXT + ids, TEXT[:2], long]


def run(llm: LLM) -> dict:
    runner = llm.llm_engine.executor.worker.model_runner
    outputs = []
    with llm:
        for batch in prompts():
            for out in llm.generate(batch, GREEDY, use_tqdm=False):
                seq = out.outputs[0]
                logprobs = [{t: lp.logprob for t, lp in d.items()} for d in seq.logprobs]
                outputs.append({"token_ids": seq.token_ids, "logprobs": logprobs})
        stack = runner.model.model.__dict__.get("_fused_decode_stack")
        packed = [
            part
            for module in runner.model.modules()
            for part in getattr(getattr(module, "quant_method", None), "parts", ())
            if isinstance(part, quantized_matmul.PackedLinearWeight)
        ]
    return {
        "dtype": llm.llm_engine.config.model_config.dtype,
        "quantization": getattr(llm.llm_engine.config.model_config.quantization, "method", None),
        "fused": type(stack).__name__,
        "int8_act": sorted({part.int8_act for part in packed}),  # the model's packed weights
        "outputs": outputs,
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    native = run(LLM(**COMMON))
    reference = run(LLM(gguf_dequantize=True, dtype=native["dtype"], **COMMON))
    op = quantized_matmul._kernel()
    prefill = quantized_matmul.prefill_gemm(op)
    if prefill is None and quantized_matmul.float32_int8(op):
        prefill = "int8"  # the AVX2 path's batches on int8 activations (VPMADDUBSW)
    print(
        json.dumps(
            {"path": cpu_path().name, "prefill": prefill, "native": native, "reference": reference}
        )
    )


if __name__ == "__main__":
    main()
