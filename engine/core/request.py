"""Request: one sequence the scheduler tracks, from arrival to finish."""

from __future__ import annotations

import enum
import time

from llmctl.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Finished states follow.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache (first schedule)
        self.num_preemptions = 0
        self.num_tokens_sent = 0  # tokens the workers know (to send only what is new)
        self.in_flight = False  # scheduled in a batch whose output has not come back
        self.block_hashes: list[int] = []  # content hashes of the full blocks, for prefix caching

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def is_finished(self) -> bool:
        return self.status.is_finished
