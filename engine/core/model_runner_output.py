"""What a step hands back: one sampled token per request that reached its end, or (a pipeline stage
before the last) the hidden states for the next stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # A stage before the last: the tensors for the next stage ({"hidden_states": [num_tokens,
    # hidden_size], "residual": ...}); the worker sends them on and never returns them.
    intermediate_tensors: Any = None
