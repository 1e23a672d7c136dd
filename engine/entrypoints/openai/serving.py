"""What the completions and chat endpoints share: decoding the body, checks against the served
model, tokenizing with the context-length check, running one engine request per prompt with latency
metrics, merging streams, server-sent events and usage counts.

`prepare` (decode, validate, template, tokenize) is CPU work that grows with the body: the server
runs it in worker threads, never on the event loop. Everything after it is async and cheap.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from llmctl.engine.client.protocol import EngineClient
from llmctl.engine.entrypoints.openai.errors import error_body
from llmctl.engine.entrypoints.openai.metrics import ServerMetrics
from llmctl.engine.entrypoints.openai.request_body import parse_json_body, validate
from llmctl.engine.errors import InvalidRequestError, PromptTooLongError
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

_DISCONNECT_POLL_S = 0.5


class ModelNotFound(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclass
class Prepared:
    """A request ready for the engine: its body, sampling parameters and prompts."""

    body: Any
    params: SamplingParams
    prompts: list[PreparedPrompt]


@dataclass
class PreparedPrompt:
    text: str | None
    token_ids: list[int]

    def engine_prompt(self) -> dict:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class OpenAIServing:
    request_type: type  # the pydantic model of the endpoint's body

    def __init__(
        self, engine_client: EngineClient, model_name: str, metrics: ServerMetrics
    ) -> None:
        self.engine_client = engine_client
        self.model_name = model_name
        self.metrics = metrics
        engine = engine_client.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.model_config.max_model_len

    def prepare(self, raw: bytes) -> Prepared:
        """The request in `raw` (a JSON body), decoded, validated and tokenized. Runs in a worker
        thread. Raises InvalidRequestError (400, naming the field) or ModelNotFound (404)."""
        body = validate(self.request_type, parse_json_body(raw))
        if body.model is not None and body.model != self.model_name:
            raise ModelNotFound(body.model)
        return self.prepare_body(body)

    def prepare_body(self, body) -> Prepared:
        raise NotImplementedError

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool, field: str):
        if isinstance(prompt, list):
            return PreparedPrompt(None, list(prompt))
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"the {field} is text, but this server runs without a tokenizer "
                "(--skip-tokenizer-init)",
                "send the prompt as token ids",
                param=field,
            )
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return PreparedPrompt(prompt, ids)

    def returns_token_ids(self, body) -> bool:
        """vLLM's return_token_ids; always on without a tokenizer (text is then empty)."""
        return body.return_token_ids or self.tokenizer is None

    def check_length(self, prompt: PreparedPrompt, params: SamplingParams, field: str) -> None:
        """OpenAI's rule: prompt + max_tokens must fit in the context (the engine would cut)."""
        n = len(prompt.token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens; your "
                f"{field} has {n} tokens, which leaves no room to generate",
                f"shorten the {field}",
                param=field,
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + params.max_tokens} tokens ({n} in the {field}, "
                f"{params.max_tokens} in the completion)",
                f"lower max_tokens to {self.max_model_len - n} or less",
                param="max_tokens",
            )

    async def run(
        self, prompt: PreparedPrompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt, observing TTFT, inter-token latency, e2e. A
        non-streamed request (output_kind FINAL_ONLY) has one output: its TTFT is the engine's
        (its first token's time after its arrival there), and no inter-token latencies."""
        arrival = time.monotonic()
        last = None
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        async for output in self.engine_client.generate(prompt.engine_prompt(), params, request_id):
            now = time.monotonic()
            engine_ttft = output.metrics.get("first_token_time", 0.0) - output.metrics.get(
                "arrival_time", 0.0
            )
            if final_only and "first_token_time" in output.metrics:
                self.metrics.time_to_first_token.observe(engine_ttft)
            elif last is None:
                self.metrics.time_to_first_token.observe(now - arrival)
            else:
                self.metrics.inter_token_latency.observe(now - last)
            last = now
            if output.finished:
                self.metrics.e2e_latency.observe(now - arrival)
                for completion in output.outputs:
                    reason = completion.finish_reason or "abort"
                    self.metrics.requests.labels(self.model_name, reason).inc()
            yield output

    async def run_all(
        self, prompts: list[PreparedPrompt], params: SamplingParams, base_id: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt as its own engine request at once; yield (prompt index, output) in
        arrival order. Cancelling the iterator aborts every request still running."""
        if len(prompts) == 1:
            async for output in self.run(prompts[0], params, base_id):
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, prompt: PreparedPrompt) -> None:
            try:
                async for output in self.run(prompt, params, f"{base_id}-{index}"):
                    await queue.put((index, output))
            except BaseException as exc:
                await queue.put((index, exc))
                return
            await queue.put((index, done))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def abort_on_disconnect(request: Request, work) -> Any:
    """Await `work` (a coroutine); cancel it if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


class HeldDelta:
    """A completion's tokens (and their logprobs) received as deltas (output_kind DELTA) and not
    sent yet: a stream sends them with the next text."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list = []

    def add(self, delta: CompletionOutput) -> None:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    from llmctl.engine.entrypoints.openai.errors import describe, status_of

    return sse(error_body(status_of(exc), describe(exc), getattr(exc, "param", None)))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
