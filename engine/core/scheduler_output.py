"""What the scheduler hands the workers each step: new requests whole, running ones as diffs."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen, or one resumed after preemption (its KV recomputed)."""

    req_id: str
    token_ids: list[int]  # prompt, then any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    """A running request the workers know: only what changed since its last step."""

    req_id: str
    new_token_ids: list[int]  # tokens sampled since the workers last saw it
    new_block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # workers drop their state

    @classmethod
    def empty(cls, finished_req_ids: set[str] | None = None) -> SchedulerOutput:
        return cls([], [], {}, 0, finished_req_ids or set())
