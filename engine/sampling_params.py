"""SamplingParams: how one request turns logits into tokens, validated when it is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from llmctl.engine.errors import InvalidSamplingParamsError

# Below this temperature a request is treated as greedy (argmax), as vLLM does.
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters for text generation, in the vocabulary of vLLM and the OpenAI API.

    temperature=0 is greedy decoding. `seed` makes one request reproducible whatever else runs in
    the same batch. `stop` strings end the text and are never included in it. `logprobs=k`
    returns, for every generated token, its log-probability and the k most likely alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Tokens that end the request: EOS (unless ignore_eos) and stop_token_ids; set by the engine.
    all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        object.__setattr__(self, "stop", list(stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str, hint: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(message, hint, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"n must be at least 1, got {self.n}", "ask for n >= 1 completions")
        if self.temperature < 0:
            raise bad(
                "temperature",
                f"temperature must be non-negative, got {self.temperature}",
                "use 0 for greedy decoding or a positive value such as 0.7",
            )
        if not 0 < self.top_p <= 1:
            raise bad(
                "top_p",
                f"top_p must be in (0, 1], got {self.top_p}",
                "use 1.0 to disable nucleus sampling, or a value such as 0.9",
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(
                "top_k",
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}",
                "use top_k=0 to consider all tokens",
            )
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}", "use 0 to disable")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad(
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
                "ask for max_tokens >= 1, or None to generate up to max_model_len",
            )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(
                "min_tokens",
                f"min_tokens must be non-negative, got {self.min_tokens}",
                "use 0 to allow stopping at once",
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}",
                "lower min_tokens or raise max_tokens",
            )
        for penalty in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, penalty)
            if not -2.0 <= value <= 2.0:
                raise bad(penalty, f"{penalty} must be in [-2, 2], got {value}", "use 0 to disable")
        if self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
                "use 1.0 to disable, values above 1 discourage repetition",
            )
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad(
                "logprobs",
                f"logprobs must be a non-negative integer, got {self.logprobs}",
                "ask for the number of most likely tokens to return per position, e.g. 5",
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings", "remove the empty string")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}", "pass an int")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
