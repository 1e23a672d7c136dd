"""The OpenAI API's request bodies (pydantic), and the sampling parameters they ask for.

Field names and defaults are OpenAI's; `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `add_special_tokens`, `return_token_ids`
and `chat_template_kwargs` are vLLM's extensions, accepted the same way. Types are strict (a
string is not a number). A field this server does not implement is refused with a 400 that names
it, never ignored: the caller must not get an answer that silently did not honour its request
(`tools`, `response_format`, ...). Only fields that change nothing here are accepted as no-ops
(`user`, `metadata`, `parallel_tool_calls` without tools, ...).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

# OpenAI's own limit on completions per request.
MAX_N = 128
_STRICT = ConfigDict(extra="forbid", strict=True)


def _unset(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Fields of the OpenAI API (and of vLLM's) that this server does not implement: the value they
# may take because it asks for nothing (or None: any value asks for something), and the hint.
_NOT_IMPLEMENTED: dict[str, tuple[Any, str]] = {
    "tools": (_empty, "tool calling is not implemented; drop tools"),
    "tool_choice": (
        lambda v: v is None or v == "none",
        'tool calling is not implemented; drop tool_choice or send "none"',
    ),
    "functions": (_empty, "function calling is not implemented; drop functions"),
    "function_call": (
        lambda v: v is None or v == "none",
        "function calling is not implemented; drop function_call",
    ),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        "structured output (JSON mode, JSON schema) is not implemented; drop response_format or "
        'send {"type": "text"}',
    ),
    "audio": (_unset, "audio output is not implemented; drop audio"),
    "modalities": (
        lambda v: v is None or v == ["text"],
        'only text output is implemented; drop modalities or send ["text"]',
    ),
    "prediction": (_unset, "predicted outputs are not implemented; drop prediction"),
    "reasoning_effort": (_unset, "reasoning effort is not implemented; drop reasoning_effort"),
    "verbosity": (_unset, "verbosity is not implemented; drop verbosity"),
    "web_search_options": (_unset, "web search is not implemented; drop web_search_options"),
    "store": (
        lambda v: v is None or v is False,
        "this server does not store completions; drop store",
    ),
    "guided_json": (_unset, "guided decoding is not implemented; drop guided_json"),
    "guided_regex": (_unset, "guided decoding is not implemented; drop guided_regex"),
    "guided_choice": (_unset, "guided decoding is not implemented; drop guided_choice"),
    "guided_grammar": (_unset, "guided decoding is not implemented; drop guided_grammar"),
    "structured_outputs": (_unset, "structured output is not implemented; drop it"),
    "prompt_logprobs": (_unset, "prompt logprobs are not implemented; drop prompt_logprobs"),
    "use_beam_search": (
        lambda v: v is None or v is False,
        "beam search is not implemented; drop use_beam_search",
    ),
    "include_stop_str_in_output": (
        lambda v: v is None or v is False,
        "stop strings are always left out of the text here; drop include_stop_str_in_output",
    ),
    "truncate_prompt_tokens": (_unset, "prompt truncation is not implemented; shorten it"),
    "chat_template": (_unset, "custom chat templates are not accepted; drop chat_template"),
    "suffix": (_empty, "suffix (insertion) is not implemented; drop suffix"),
}
# Accepted and without effect: they change nothing in what is generated.
_NO_OPS = ("user", "metadata", "service_tier", "parallel_tool_calls")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

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
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def refuse_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, (accepted, hint) in _NOT_IMPLEMENTED.items():
            if name in data and not accepted(data[name]):
                raise InvalidRequestError(
                    f"{name} is not supported by this server", hint, param=name
                )
        return {k: v for k, v in data.items() if k not in _NOT_IMPLEMENTED and k not in _NO_OPS}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n > MAX_N:
            raise InvalidRequestError(
                f"n must be at most {MAX_N}, got {self.n}",
                f"ask for {MAX_N} completions or fewer per request",
                param="n",
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed with stream: true",
                "drop stream_options or set stream to true",
                param="stream_options",
            )
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
            "repetition_penalty": (
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            # a stream is sent as it grows; a whole response needs only the final output
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        }
        if self.logit_bias:
            values["logit_bias"] = _token_bias(self.logit_bias)
        return SamplingParams(**values)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as the keys of a JSON object, hence strings."""
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}",
                'map token ids to biases, e.g. {"50256": -100}',
                param="logit_bias",
            ) from None
        out[token] = value
    return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI: "Defaults to 16"; an explicit null asks for that default too.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty", "send a prompt", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # one prompt as token ids
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
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
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: None = None  # OpenAI's replies carry it (null); sent back in a conversation

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"message content part of type {part.get('type')!r} is not supported",
                        'send text content only: {"type": "text", "text": "..."}',
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    # OpenAI: no limit but the context; both null: up to max_model_len.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes them
    chat_template_kwargs: dict[str, Any] | None = None

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
        reserved = _TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or ())
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                "pass only the template's own variables, e.g. enable_thinking",
                param="chat_template_kwargs",
            )
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(limit, logprobs)


# apply_chat_template's own parameters: a template variable may not override them.
_TEMPLATE_ARGUMENTS = {
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "messages",
}  # fmt: skip
