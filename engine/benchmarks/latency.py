"""`llmctl bench latency`: vLLM's latency benchmark (one batch, end to end), and the device's
limit for its decode and its prefill apart.

Each iteration generates `output_len` tokens for a batch of `batch_size` prompts of `input_len`
random token ids (new ones each iteration, so no prefix is cached). The result has vLLM's keys
(avg_latency, latencies, percentiles) plus a prefill-only pass (max_tokens 1) timed the same way
for the prefill's figures. The decode steps' time is measured inside each iteration, from the
batch's last first token to its end (the requests' first_token_time). Decode: bytes a step reads
(weights and KV cache, ModelCost) per second, against the bandwidth; prefill: FLOPs per second,
against the peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from llmctl.engine.benchmarks.datasets import random_requests
from llmctl.engine.config.options import option
from llmctl.engine.errors import ConfigError

PERCENTILES = (10, 25, 50, 75, 90, 99)


BENCH_LATENCY = "bench-latency"  # the OptionSpec command of the fields below
_OPTION = dict(panel="Benchmark", commands=(BENCH_LATENCY,), show_default=True)


@dataclass(frozen=True)
class LatencyArgs:
    """The workload, under vLLM's flags."""

    batch_size: int = option("Prompts per batch.", default=8, **_OPTION)
    input_len: int = option("Prompt tokens per request.", default=32, **_OPTION)
    output_len: int = option("Tokens generated per request.", default=128, **_OPTION)
    num_iters_warmup: int = option("Untimed iterations first.", default=10, **_OPTION)
    num_iters: int = option("Timed iterations.", default=30, **_OPTION)
    n: int = option("Completions per prompt.", default=1, **_OPTION)
    seed: int = option("Seed of the random prompts.", default=0, **_OPTION)

    def __post_init__(self) -> None:
        if self.num_iters < 1 or self.num_iters_warmup < 0:
            raise ConfigError(
                f"num_iters must be at least 1 and num_iters_warmup non-negative, got "
                f"{self.num_iters} and {self.num_iters_warmup}",
                "pass --num-iters 30 --num-iters-warmup 10",
            )


def run_latency(
    engine_kwargs: dict[str, Any], args: LatencyArgs, progress: bool = True
) -> dict[str, Any]:
    from llmctl.engine.entrypoints.llm import LLM

    with LLM(use_tqdm_on_load=progress, **engine_kwargs) as llm:
        return measure_latency(llm, args, progress)


def measure_latency(llm, args: LatencyArgs, progress=None) -> dict[str, Any]:
    """`progress`: None, or a callable(done, total, description) advanced per iteration."""
    import numpy as np

    from llmctl.engine.benchmarks.device_limit import device_limit
    from llmctl.engine.benchmarks.roofline import ModelCost
    from llmctl.engine.sampling_params import SamplingParams

    engine = llm.llm_engine
    config = engine.config
    vocab = config.model_config.shape.vocab_size
    report = progress if callable(progress) else (lambda done, total, what: None)

    def batch(iteration: int) -> list[list[int]]:
        requests = random_requests(
            args.batch_size, args.input_len, args.output_len, vocab, args.seed + iteration
        )
        return [r.prompt_token_ids for r in requests]

    def timed(max_tokens: int, iterations: range, what: str) -> tuple[list[float], list[float]]:
        """Each iteration's seconds, and its decode steps' (its last first token to its end;
        none where the outputs carry no first-token time)."""
        params = SamplingParams(
            n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=max_tokens
        )
        seconds, decoding = [], []
        for done, i in enumerate(iterations, 1):
            prompts = batch(i)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            end = time.monotonic()  # the clock of the outputs' metrics
            seconds.append(time.perf_counter() - start)
            firsts = [o.metrics.get("first_token_time") for o in outputs]
            if firsts and None not in firsts:
                decoding.append(end - max(firsts))
            report(done, len(iterations), what)
        return seconds, decoding

    cost = ModelCost.from_config(config, engine.executor.rank_info())
    limit = device_limit(config.device_config.device, config.model_config.dtype)
    timed(args.output_len, range(args.num_iters_warmup), "Warm-up iterations")
    offset = args.num_iters_warmup
    iterations = range(offset, offset + args.num_iters)
    latencies, decoding = timed(args.output_len, iterations, "Iterations")
    # The decode steps' time, measured inside each iteration (not the difference of two runs'
    # averages, which a busy machine's noise could make negative for a small model)
    decode_s = float(np.mean(decoding)) if len(decoding) == len(latencies) else None
    prefill_iters = max(3, args.num_iters // 3)
    offset += args.num_iters
    prefills, _ = timed(1, range(offset, offset + prefill_iters), "Prefill-only iterations")

    avg, avg_prefill = float(np.mean(latencies)), float(np.mean(prefills))
    prompt_lens = [args.input_len] * args.batch_size * args.n
    result: dict[str, Any] = {
        "avg_latency": avg,
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
        "avg_prefill_latency": avg_prefill,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "device_limit": limit.as_dict(),
    }
    flops = cost.prefill_flops([args.input_len] * args.batch_size)
    result["prefill"] = {
        "flops": flops,
        "achieved_flops_per_s": flops / avg_prefill,
        "fraction_of_peak": flops / avg_prefill / limit.peak_flops,
    }
    steps = args.output_len - 1
    if decode_s is None:  # outputs without first-token times
        decode_s = avg - avg_prefill
    if steps > 0 and decode_s > 0:
        decode_bytes = cost.decode_bytes(prompt_lens, args.output_len)
        result["decode"] = {
            "steps": steps,
            "ms_per_step": 1000 * decode_s / steps,
            "bytes_per_step": decode_bytes / steps,
            "achieved_bandwidth": decode_bytes / decode_s,
            "fraction_of_bandwidth": decode_bytes / decode_s / limit.bandwidth,
        }
    ideal = (
        flops / limit.peak_flops
        + result.get("decode", {}).get("bytes_per_step", 0) * max(steps, 0) / limit.bandwidth
    )
    result["fraction_of_limit"] = ideal / avg
    return result
