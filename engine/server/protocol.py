"""The OpenAI API's request bodies (pydantic), and the sampling parameters they ask for.

Field names and defaults are OpenAI's; `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos` and `stop_token_ids` are vLLM's extensions, accepted the same way. Unknown fields are
ignored, as OpenAI's clients send some (e.g. `user`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": self.repetition_penalty or 1.0,
            "logprobs": logprobs,
        }
        return SamplingParams(**values)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # one prompt as token ids
        if not prompt:
            raise InvalidRequestError("prompt is empty", "send a prompt", param="prompt")
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError(
                "suffix is not supported", "drop the suffix field", param="suffix"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of={self.best_of} is not supported (only best_of == n)",
                "drop best_of, or set it equal to n",
                param="best_of",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be between 0 and 20, got {self.logprobs}",
                "ask for at most 20 alternatives per token",
                param="logprobs",
            )
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequestError(
                        f"message content part of type {part.get('type')!r} is not supported",
                        "send text content only",
                        param="messages",
                    )
                texts.append(part.get("text", ""))
            content = "".join(texts)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise InvalidRequestError(
                "messages is empty", "send at least one message", param="messages"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs needs logprobs=true", "set logprobs to true", param="top_logprobs"
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and 20, got {self.top_logprobs}",
                "ask for at most 20 alternatives per token",
                param="top_logprobs",
            )
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(limit, logprobs)
