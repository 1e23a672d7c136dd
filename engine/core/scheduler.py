"""Scheduler: continuous batching with a token budget per step. Pure Python.

Every step, running requests go first (a decode token each, or the next chunk of a long prompt),
then waiting requests are admitted while the token budget, `max_num_seqs` and free KV blocks allow;
a prompt longer than the remaining budget is prefilled in chunks over several steps. When a running
request needs a block and none is free, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed from its prompt and the tokens
it already produced, so nothing it generated is lost.

A LongRoPE model (Phi-3) computes a request's KV with its short factors while the request holds
at most `long_rope_threshold` tokens and with its long ones past that, as transformers does: the
request that grows past it is sent back to the front of the queue to be computed again, whole,
with the long factors (not counted as a preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmctl.engine.config.engine_config import CacheConfig, SchedulerConfig
from llmctl.engine.core.block_manager import BlockManager
from llmctl.engine.core.model_runner_output import ModelRunnerOutput, TokenLogprobs
from llmctl.engine.core.request import Request, RequestStatus
from llmctl.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class EngineCoreOutput:
    """One request's progress in one step, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        reuse_written_first: bool = False,
        sliding_windows: tuple[int | None, ...] = (None,),
        long_rope_threshold: int | None = None,
    ) -> None:
        """`reuse_written_first`: the KV cache's memory is committed as it is first written (the
        CPU's): reuse written blocks before fresh ones (block_manager.py). `sliding_windows`:
        each KV cache group's window (KVCacheLayout.sliding_windows). `long_rope_threshold`:
        see the module doc (config/rope_parameters.py)."""
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            reuse_written_first=reuse_written_first,
            sliding_windows=sliding_windows,
            long_rope_threshold=long_rope_threshold,
        )
        self.long_rope_threshold = long_rope_threshold
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the workers at the next step
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> SchedulerStats:
        stats = self.block_manager.stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
        )

    # -- one step ------------------------------------------------------------------------------

    def _batch_size_cap(self) -> int:
        """Most requests in one batch: with several batches in flight (pipeline parallelism),
        the active requests are shared out so that every stage has a batch to work on."""
        cap = self.config.max_num_seqs
        batches = self.config.max_concurrent_batches
        if batches > 1:
            active = min(len(self.running) + len(self.waiting), cap)
            cap = max(1, -(-active // batches))
        return cap

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        cap = self._batch_size_cap()
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[list[int]]] = {}  # per KV cache group
        preempted = False

        # Running requests first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < cap:
            request = self.running[i]
            if request.in_flight:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                blocks = self.block_manager.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if blocks is None:
                continue  # this request itself was preempted; self.running shrank
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = blocks
            budget -= num_new
            i += 1

        # Then waiting requests, unless this step had to preempt (memory is short).
        new_requests: list[Request] = []
        while self.waiting and budget > 0 and not preempted and len(num_scheduled) < cap:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            computed_blocks, num_computed = self.block_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_computed, budget)
            blocks = self.block_manager.allocate_slots(request, num_new, computed_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            num_scheduled[request.request_id] = num_new
            new_requests.append(request)
            budget -= num_new

        output = self._make_output(num_scheduled, new_block_ids, new_requests)
        # The scheduled tokens count as computed from now on: the next schedule() (of a
        # pipelined batch) must not schedule them again.
        for request_id, num in num_scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num
            request.in_flight = True
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish requests that hit a stop condition."""
        outputs: list[EngineCoreOutput] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.in_flight = False
            if request.is_finished():
                continue  # aborted while its batch was in flight
            token = runner_output.sampled_token_ids.get(request_id)
            if token is None:
                continue  # a chunk of a prompt that is not yet complete
            request.all_token_ids.append(token)
            finished = self._check_stop(request)
            if finished:
                self.running.remove(request)
                self._free(request)
            elif request.num_tokens - 1 == self.long_rope_threshold:
                self._recompute(request)  # its KV so far has the short factors
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[token],
                    logprobs=runner_output.logprobs.get(request_id),
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        return outputs

    # -- internals -----------------------------------------------------------------------------

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        token = request.all_token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
        return False

    def _pick_victim(self) -> Request:
        """The newest running request whose batch is not in flight."""
        for request in reversed(self.running):
            if not request.in_flight:
                return request
        raise RuntimeError("every running request is in flight; nothing can be preempted")

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _recompute(self, request: Request) -> None:
        """Free the request's KV and queue it first, to be computed again from its tokens."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.block_hashes.clear()  # named again, as a long request's
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.block_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _make_output(
        self,
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, list[list[int]]],
        new_requests: list[Request],
    ) -> SchedulerOutput:
        new_reqs = []
        for request in new_requests:
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.block_manager.block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            request.num_tokens_sent = request.num_tokens
        cached_reqs = []
        for request_id, blocks in new_block_ids.items():
            request = self.requests[request_id]
            cached_reqs.append(
                CachedRequestData(
                    req_id=request_id,
                    new_token_ids=request.all_token_ids[request.num_tokens_sent :],
                    new_block_ids=blocks,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            request.num_tokens_sent = request.num_tokens
        # Workers learn of finished requests with the next batch they run.
        finished = set()
        if num_scheduled:
            finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
        )
