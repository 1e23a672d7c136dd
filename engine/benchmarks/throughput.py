"""`llmctl bench throughput`: vLLM's offline throughput benchmark, and the device's limit.

All prompts go to `LLM.generate` at once (random token ids, EOS ignored, temperature 1 as vLLM
samples); the result has vLLM's keys (elapsed_time, num_requests, total_num_tokens,
requests_per_second, tokens_per_second) plus the output tokens' rate and what the run reached of
the device's limit: the workload's prefill FLOPs at the peak plus its decode bytes at the
bandwidth (the requests decoding in waves of as many as the engine runs at once), over the time
it took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from llmctl.engine.benchmarks.datasets import check_dataset, random_requests
from llmctl.engine.config.options import option

BENCH_THROUGHPUT = "bench-throughput"  # the OptionSpec command of the fields below
_OPTION = dict(panel="Benchmark", commands=(BENCH_THROUGHPUT,), show_default=True)


@dataclass(frozen=True)
class ThroughputArgs:
    """The workload, under vLLM's flags."""

    input_len: int = option("Prompt tokens per request.", default=1024, **_OPTION)
    output_len: int = option("Tokens generated per request.", default=128, **_OPTION)
    num_prompts: int = option("Requests.", default=1000, **_OPTION)
    dataset_name: str = option("random: random token ids.", default="random", **_OPTION)
    n: int = option("Completions per prompt.", default=1, **_OPTION)
    seed: int = option("Seed of the random prompts.", default=0, **_OPTION)
    random_range_ratio: float = option(
        "Spread prompt and output lengths uniformly by this fraction around the lengths given.",
        default=0.0,
        **_OPTION,
    )

    def __post_init__(self) -> None:
        check_dataset(self.dataset_name)


def run_throughput(
    engine_kwargs: dict[str, Any], args: ThroughputArgs, progress: bool = True
) -> dict[str, Any]:
    """Build the engine, run the workload once after a short warm-up, report (see the doc)."""
    from llmctl.engine.entrypoints.llm import LLM

    with LLM(use_tqdm_on_load=progress, **engine_kwargs) as llm:
        return measure_throughput(llm, args, progress)


def measure_throughput(llm, args: ThroughputArgs, progress: bool = True) -> dict[str, Any]:
    from llmctl.engine.benchmarks.device_limit import device_limit
    from llmctl.engine.benchmarks.roofline import ModelCost, roofline_report
    from llmctl.engine.sampling_params import SamplingParams

    engine = llm.llm_engine
    config = engine.config
    requests = random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        config.model_config.shape.vocab_size,
        args.seed,
        args.random_range_ratio,
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(
            n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len
        )
        for r in requests
    ]
    cost = ModelCost.from_config(config, engine.executor.rank_info())
    limit = device_limit(config.device_config.device, config.model_config.dtype)
    warm = random_requests(
        2, args.input_len, 4, config.model_config.shape.vocab_size, args.seed + 1
    )
    llm.generate(  # compiles kernels, fills the allocator's pools
        [r.prompt_token_ids for r in warm],
        SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=4),
        use_tqdm=False,
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start

    prompt_tokens = sum(len(p) for p in prompts) * args.n
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    at_once = concurrent_sequences(engine, args.input_len + args.output_len)
    sequences = [(len(r.prompt_token_ids), r.output_len) for r in requests for _ in range(args.n)]
    decode_bytes = sum(
        cost.decode_bytes([n for n, _ in wave], max(m for _, m in wave))
        for wave in _waves(sequences, at_once)
    )
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
        "total_output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / elapsed,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    prefill_flops = cost.prefill_flops([n for n, _ in sequences[:: args.n]])
    return result | roofline_report(limit, prefill_flops, decode_bytes, elapsed)


def concurrent_sequences(engine, tokens_per_sequence: int) -> int:
    """How many sequences of this length the engine runs at once: max_num_seqs, or fewer when
    the KV cache holds fewer."""
    block = engine.config.cache_config.block_size
    fit = engine.num_blocks // -(-tokens_per_sequence // block)
    return max(1, min(engine.config.scheduler_config.max_num_seqs, fit))


def _waves(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
