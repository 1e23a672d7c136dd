"""What the workers hand back each step: one sampled token per request that reached its end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the sampled token and the top-k (most likely first)."""

    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    # req_id -> sampled token; requests in the middle of a chunked prefill sample nothing.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
