"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text, logprobs).

A request with n > 1 runs as n child sequences (ids "0_<id>", "1_<id>", ...); their progress is
gathered back into one RequestOutput with n CompletionOutputs. Stop strings are found here, by
the detokenizer; the engine then finishes those sequences in the scheduler.

A step's work is proportional to the tokens it produced, not to the outputs' lengths (tests/
engine/test_output_work.py counts it): tokens are appended, decoded once each, and handed out as
the request's SamplingParams.output_kind asks: DELTA gives only what is new since the last output
(streaming), FINAL_ONLY one output at the end (LLM.generate, non-streamed API requests), and
CUMULATIVE everything so far (a copy per step, which grows with the output: vLLM's default for
library callers, kept for them). A FINAL_ONLY request without stop strings is not even decoded
until it finishes: its text is needed only then.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from llmctl.engine.core.detokenizer import IncrementalDetokenizer
from llmctl.engine.core.model_runner_output import TokenLogprobs
from llmctl.engine.core.scheduler import EngineCoreOutput
from llmctl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    undecoded: list[int] = field(default_factory=list)  # text ids not yet decoded (lazy)
    sent_tokens: int = 0  # token ids (and logprobs) handed out already (DELTA)
    sent_chars: int = 0  # characters of text handed out already (DELTA)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    child_ids: list[str]
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    decode_now: bool = True  # text needed every step (streamed, or stop strings to find)
    num_cached_tokens: int = 0
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[_RequestState, int]] = {}
        # Requests are added and aborted by the engine thread while the output thread
        # (core/output_thread.py) processes a step's outputs.
        self._lock = threading.Lock()

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        arrival_time: float,
    ) -> None:
        with self._lock:
            self._add(request_id, prompt, prompt_token_ids, params, child_ids, arrival_time)

    def _add(self, request_id, prompt, prompt_token_ids, params, child_ids, arrival_time) -> None:
        completions = []
        for index in range(len(child_ids)):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            completion = _Completion(index, detokenizer)
            if params.logprobs is not None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            completions.append(completion)
        kind = params.output_kind
        state = _RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            completions,
            list(child_ids),
            arrival_time,
            output_kind=kind,
            decode_now=kind != FINAL_ONLY or bool(params.stop),
        )
        self.requests[request_id] = state
        for index, child_id in enumerate(child_ids):
            self.child_to_parent[child_id] = (state, index)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.child_ids) if state else []

    def parent_ids(self, child_ids: list[str]) -> list[str]:
        """The requests these sequences belong to (unknown ones left out), each once."""
        with self._lock:
            entries = (self.child_to_parent.get(c) for c in child_ids)
            return list(dict.fromkeys(e[0].request_id for e in entries if e is not None))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished completion aborted; return the final output (None if unknown)."""
        with self._lock:
            return self._abort(request_id)

    def _abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
            if completion.undecoded:
                completion.detokenizer.update(completion.undecoded, True)
                completion.undecoded = []
        for child_id in state.child_ids:
            del self.child_to_parent[child_id]
        return self._make_output(state)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs of the requests that progressed, and the child ids that hit a stop
        string (to be finished in the scheduler)."""
        with self._lock:
            return self._process(outputs)

    def _process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        touched: dict[str, _RequestState] = {}
        stopped: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:
                continue
            state, index = entry
            completion = state.completions[index]
            if completion.finish_reason is not None:
                continue  # a stop string ended it; the engine ran it on until it heard
            if state.first_token_time is None:
                state.first_token_time = now
            if self._apply(state, completion, out):
                stopped.append(out.request_id)
            touched[state.request_id] = state
        results = []
        for request_id, state in touched.items():
            if state.output_kind != FINAL_ONLY or state.finished:
                results.append(self._make_output(state))
            if state.finished:
                del self.requests[request_id]
                for child_id in state.child_ids:
                    del self.child_to_parent[child_id]
        return results, stopped

    def _apply(self, state: _RequestState, completion: _Completion, out: EngineCoreOutput) -> bool:
        """Add one step's tokens to a completion; True when a stop string ended it here."""
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        completion.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None and completion.logprobs is not None:
            completion.logprobs.append(self._logprobs(out.new_token_ids[-1], out.logprobs))
            completion.cumulative_logprob += out.logprobs.sampled_logprob
        finished = out.finish_reason is not None
        text_ids = out.new_token_ids
        if out.finish_reason == "stop":
            text_ids = text_ids[:-1]  # a stop token (EOS or stop_token_ids) is not text
        if not (state.decode_now or finished):
            completion.undecoded.extend(text_ids)  # decoded when it finishes
            return False
        if completion.undecoded:
            text_ids, completion.undecoded = completion.undecoded + text_ids, []
        stop_string = completion.detokenizer.update(text_ids, finished)
        if stop_string is not None and not finished:
            completion.finish_reason, completion.stop_reason = "stop", stop_string
            return True
        if finished:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _make_output(self, state: _RequestState) -> RequestOutput:
        delta = state.output_kind == DELTA
        outputs = [self._delta(c) if delta else self._cumulative(c) for c in state.completions]
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
        )

    @staticmethod
    def _cumulative(c: _Completion) -> CompletionOutput:
        return CompletionOutput(
            index=c.index,
            text=c.detokenizer.get_text(c.finish_reason is not None),
            token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    @staticmethod
    def _delta(c: _Completion) -> CompletionOutput:
        """What is new since the completion's last output: its tokens and logprobs, and the
        text that may be shown (a possible stop string's start waits)."""
        detokenizer = c.detokenizer
        visible = detokenizer.visible_length(c.finish_reason is not None)
        text = detokenizer.text_between(c.sent_chars, visible)
        token_ids = c.token_ids[c.sent_tokens :]
        logprobs = c.logprobs[c.sent_tokens :] if c.logprobs is not None else None
        c.sent_chars = max(c.sent_chars, visible)
        c.sent_tokens = len(c.token_ids)
        return CompletionOutput(
            index=c.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _logprobs(self, sampled: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for rank, (token_id, logprob) in enumerate(
            zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1
        ):
            entry[token_id] = Logprob(logprob, rank, self._decode_token(token_id))
        if sampled not in entry:
            entry[sampled] = Logprob(
                lp.sampled_logprob, lp.sampled_rank, self._decode_token(sampled)
            )
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])
