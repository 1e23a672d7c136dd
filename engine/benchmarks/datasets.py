"""The benchmarks' requests: vLLM's `random` dataset (the one that needs no files).

Each prompt is `input_len` token ids drawn uniformly from the vocabulary (ids below
`first_id` skipped: special tokens), with lengths spread uniformly over
[len * (1 - range_ratio), len * (1 + range_ratio)] as vLLM's --random-range-ratio spreads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.engine.errors import ConfigError

DATASETS = ("random",)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def check_dataset(name: str) -> None:
    if name not in DATASETS:
        raise ConfigError(
            f"unknown dataset {name!r}",
            f"use --dataset-name {' or '.join(DATASETS)} (random token ids of --input-len)",
        )


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    range_ratio: float = 0.0,
    first_id: int = 100,
) -> list[BenchRequest]:
    """`num_prompts` requests of random token ids (see the module doc)."""
    import numpy as np

    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ConfigError(
            f"a benchmark needs at least one prompt, one input and one output token; got "
            f"{num_prompts} prompts of {input_len} -> {output_len} tokens",
            "give --num-prompts, --input-len and --output-len of at least 1",
        )
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(
            f"range_ratio must be in [0, 1), got {range_ratio}", "pass --random-range-ratio 0.1"
        )
    rng = np.random.default_rng(seed)
    low_id = first_id if vocab_size > 2 * first_id else 0

    def lengths(n: int) -> np.ndarray:
        low, high = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    in_lens, out_lens = lengths(input_len), lengths(output_len)
    return [
        BenchRequest(rng.integers(low_id, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(in_lens, out_lens, strict=True)
    ]
