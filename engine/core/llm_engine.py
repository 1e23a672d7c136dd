"""LLMEngine: requests in, RequestOutputs out, one step at a time.

    step():  schedule()  ->  batch_queue.run(...) (the executor)  ->  postprocess()

Prompts are validated and tokenized in add_request; a bad request raises a typed error there and
never reaches the scheduler, so the requests already running are not disturbed. With
skip_tokenizer_init there is no tokenizer: prompts must be token ids and outputs carry no text.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from llmctl.engine import platform
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.engine_config import EngineConfig, check_kv_cache_fits
from llmctl.engine.config.kv_cache_layout import KVCacheLayout
from llmctl.engine.config.rope_parameters import long_rope_threshold
from llmctl.engine.core.batch_queue import BatchQueue
from llmctl.engine.core.model_runner_output import ModelRunnerOutput
from llmctl.engine.core.output_processor import OutputProcessor
from llmctl.engine.core.output_thread import OutputThread
from llmctl.engine.core.request import Request, RequestStatus
from llmctl.engine.core.scheduler import Scheduler
from llmctl.engine.core.scheduler_output import SchedulerOutput
from llmctl.engine.errors import InvalidRequestError, PromptTooLongError
from llmctl.engine.executor.base import Executor
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.tokenizer.tokenizer import eos_token_ids, get_tokenizer

logger = logging.getLogger("llmctl")

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids" (as vLLM accepts).
PromptType = str | list[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which served from it
    prompt_tokens: int  # prompt tokens admitted
    generation_tokens: int  # tokens sampled

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class LLMEngine:
    def __init__(self, engine_config: EngineConfig, progress=None) -> None:
        self.config = engine_config
        mc, cc = engine_config.model_config, engine_config.cache_config
        # skip_tokenizer_init: no tokenizer; prompts are token ids and outputs carry no text.
        self.tokenizer = None if mc.skip_tokenizer_init else get_tokenizer(mc.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc.path)
        self.vocab_size = mc.shape.vocab_size
        # How the attention layers share the KV cache (sliding-window groups free blocks).
        self.kv_layout = KVCacheLayout.for_shape(mc.shape, mc.max_model_len, cc.block_size)
        self.executor = Executor.get_class(engine_config)(engine_config, progress)
        try:
            self.num_blocks = self.executor.determine_num_available_blocks()
            knob = (
                "--kv-cache-space-gib"
                if engine_config.device_config.device == "cpu"
                else "--gpu-memory-utilization or use more GPUs (-tp/-pp)"
            )
            check_kv_cache_fits(
                self.num_blocks,
                cc.block_size,
                mc.max_model_len,
                knob,
                self.kv_layout,
                engine_config.scheduler_config.max_num_batched_tokens,
            )
            self.executor.initialize_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self._log_kv_cache()
        self.scheduler = Scheduler(
            engine_config.scheduler_config,
            cc,
            self.num_blocks,
            reuse_written_first=engine_config.device_config.device == "cpu",
            sliding_windows=self.kv_layout.sliding_windows,
            long_rope_threshold=long_rope_threshold(mc.hf_config),
        )
        # The pipeline's batches in flight: one per stage unless max_concurrent_batches says.
        sc = engine_config.scheduler_config
        self.batch_queue = BatchQueue(
            self.executor,
            sc.max_concurrent_batches,
            lockstep=engine_config.parallel_config.expert_parallel_across_dp,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._ids = itertools.count()
        platform.freeze_startup_heap()  # after everything the engine keeps is built

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, progress=None) -> LLMEngine:
        return cls(engine_args.create_engine_config(progress), progress)

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate, tokenize and queue a request; returns its id. Raises InvalidRequestError."""
        self.executor.check_alive()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use", "give each request its own id"
            )
        params = sampling_params or SamplingParams()
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._validate_prompt(prompt_ids)
        self._validate_params(params)
        max_len = self.config.model_config.max_model_len
        room = max_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        params = params.replace(all_stop_token_ids=frozenset(stop_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = (
            [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        )
        self.output_processor.add_request(
            request_id, prompt_text, prompt_ids, params, child_ids, arrival
        )
        for i, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = params.replace(n=1, seed=seed)
            self.scheduler.add_request(
                Request(child_id, prompt_ids, child_params, self.eos_token_ids, max_tokens, arrival)
            )
            self._prompt_tokens += len(prompt_ids)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests and free their KV blocks; returns their final (aborted) outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            final = self.output_processor.abort_request(request_id)
            if final is not None:
                finals.append(final)
        return finals

    def finish_stopped(self, child_ids: list[str]) -> None:
        """Sequences whose text hit a stop string (found off the step by the output thread)."""
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_STOPPED)

    def check_alive(self) -> None:
        """Raises EngineDeadError (WorkerError naming the rank) if a worker died."""
        self.executor.check_alive()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def release_idle_memory(self) -> None:
        """Every worker gives back the heap pages its steps freed (the CPU's; a no-op on GPUs).
        The server calls this when its last request finished, not between steps."""
        self.executor.collective_rpc("release_free_heap")

    # -- the loop ------------------------------------------------------------------------------

    def step(self, output_thread: OutputThread | None = None) -> list[RequestOutput]:
        """One step; its RequestOutputs, or none when `output_thread` (EngineCore's) turns
        its tokens into outputs and delivers them, off the step."""
        scheduler_output = self.scheduler.schedule()
        finished_batch = self.batch_queue.run(scheduler_output)
        return self.postprocess(finished_batch, output_thread)

    def postprocess(
        self,
        finished_batch: tuple[SchedulerOutput, ModelRunnerOutput] | None,
        output_thread: OutputThread | None = None,
    ) -> list[RequestOutput]:
        """Apply a finished batch's tokens (None: the pipeline is still filling)."""
        if finished_batch is None:
            return []
        scheduler_output, runner_output = finished_batch
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._generation_tokens += len(core_outputs)
        if output_thread is not None:  # core/output_thread.py
            output_thread.submit(core_outputs)
            return []
        request_outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
        platform.thaw_startup_heap()

    # -- internals -----------------------------------------------------------------------------

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return text, self._tokenize(list(prompt["prompt_token_ids"]))[1]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    "a prompt dict needs a 'prompt' or 'prompt_token_ids' key",
                    'pass {"prompt": "text"} or {"prompt_token_ids": [1, 2, 3]}',
                    param="prompt",
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this engine has no tokenizer to turn a text prompt into token ids (started "
                    "with skip_tokenizer_init, or with dummy weights from a config.json without "
                    "tokenizer files)",
                    'send token ids instead: a list of ints or {"prompt_token_ids": [...]}; or '
                    "start it with --tokenizer DIR (a directory holding the model's tokenizer)",
                    param="prompt",
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
            "pass text, or a list of ints",
            param="prompt",
        )

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError(
                "the prompt is empty", "give at least one token of prompt", param="prompt"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                "use token ids produced by this model's tokenizer",
                param="prompt",
            )
        max_len = self.config.model_config.max_model_len
        if len(prompt_ids) >= max_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens, but max_model_len is {max_len}: "
                "no room is left to generate",
                f"shorten the prompt below {max_len} tokens, or raise --max-model-len",
                param="prompt",
            )

    def _validate_params(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need the output detokenized, but this engine was started with "
                "skip_tokenizer_init",
                "use stop_token_ids instead, or start the engine without skip_tokenizer_init",
                param="stop",
            )
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"logit_bias token id {bad[0]} is outside the vocabulary "
                    f"[0, {self.vocab_size})",
                    f"use token ids below the model's vocab_size of {self.vocab_size}",
                    param="logit_bias",
                )

    def _log_kv_cache(self) -> None:
        bs = self.config.cache_config.block_size
        max_len = self.config.model_config.max_model_len
        layout = KVCacheLayout.for_shape(self.config.model_config.shape, max_len, bs)
        tokens = layout.cache_tokens(self.num_blocks)
        chunk = self.config.scheduler_config.max_num_batched_tokens
        # vLLM's words on CUDA ("GPU KV cache size"); the plan prints the same lines.
        where = "GPU " if self.config.device_config.device == "cuda" else ""
        logger.info("# KV cache blocks: %d (block size %d)", self.num_blocks, bs)
        if layout.num_groups > 1:
            logger.info(
                "KV cache groups: %d (%s), blocks beyond a sliding window freed",
                layout.num_groups,
                layout.describe(),
            )
        logger.info("%sKV cache size: %s tokens", where, f"{tokens:,}")
        logger.info(
            "Maximum concurrency for %s tokens per request: %.2fx",
            f"{max_len:,}",
            layout.max_concurrency(self.num_blocks, max_len, chunk),
        )
