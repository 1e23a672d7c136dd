"""SamplingParams: how one request turns logits into tokens, validated when it is built."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, field

from llmctl.engine.errors import InvalidSamplingParamsError

# Below this temperature a request is treated as greedy (argmax), as vLLM does.
_GREEDY_EPS = 1e-5
_MAX_LOGIT_BIAS = 100.0  # as the OpenAI API bounds it

# The float fields, each with a value to suggest when it is not a finite number.
_FLOAT_HINTS = {
    "temperature": "use 0 for greedy decoding or a positive value such as 0.7",
    "top_p": "use 1.0 to disable nucleus sampling, or a value such as 0.9",
    "min_p": "use 0 to disable, or a value such as 0.05",
    "presence_penalty": "use 0 to disable, or a value in [-2, 2]",
    "frequency_penalty": "use 0 to disable, or a value in [-2, 2]",
    "repetition_penalty": "use 1.0 to disable, or a value such as 1.1",
}
# The integer fields that may be None.
_OPTIONAL_INT_FIELDS = ("max_tokens", "logprobs", "seed")


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step (a copy that grows with the output)
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate, non-streamed API)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters for text generation, in the vocabulary of vLLM and the OpenAI API.

    temperature=0 is greedy decoding. `seed` makes one request reproducible whatever else runs in
    the same batch. `stop` strings end the text and are never included in it. `output_kind`
    says whether each output is cumulative, a delta, or only the final one. `logprobs=k`
    returns, for every generated token, its log-probability and the k most likely alternatives
    (of the model's own distribution, before penalties and `logit_bias`). `logit_bias` maps token
    ids to a bias in [-100, 100] added to their logits before sampling, as in the OpenAI API.
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
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
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
        if self.logit_bias is not None:
            bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias or None)  # None: the sampler's fast path

    def _validate(self) -> None:
        def bad(param: str, message: str, hint: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(message, hint, param=param)

        # Types first: NaN passes every range check (its comparisons are all false), and True
        # would pass as the integer 1.
        for name, hint in _FLOAT_HINTS.items():
            value = getattr(self, name)
            if not _is_finite_number(value):
                raise bad(name, f"{name} must be a finite number, got {value!r}", hint)
        for name in ("n", "top_k", "min_tokens", *_OPTIONAL_INT_FIELDS):
            value = getattr(self, name)
            if (value is not None or name not in _OPTIONAL_INT_FIELDS) and not _is_int(value):
                raise bad(
                    name, f"{name} must be an integer, got {value!r}", f"pass {name} as an int"
                )
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise bad(
                "stop_token_ids",
                f"stop_token_ids must be integers, got {self.stop_token_ids!r}",
                "pass a list of token ids (ints)",
            )
        self._validate_logit_bias()
        if self.n < 1:
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
        if self.top_k < 0:
            raise bad(
                "top_k",
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}",
                "use top_k=0 to consider all tokens",
            )
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}", "use 0 to disable")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
                "ask for max_tokens >= 1, or None to generate up to max_model_len",
            )
        if self.min_tokens < 0:
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
        if self.logprobs is not None and self.logprobs < 0:
            raise bad(
                "logprobs",
                f"logprobs must be a non-negative integer, got {self.logprobs}",
                "ask for the number of most likely tokens to return per position, e.g. 5",
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings", "remove the empty string")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        hint = "map token ids (ints) to biases in [-100, 100], e.g. {50256: -100}"
        if not isinstance(bias, dict):
            raise InvalidSamplingParamsError(
                f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}",
                hint,
                param="logit_bias",
            )
        for token_id, value in bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise InvalidSamplingParamsError(
                    f"logit_bias key {token_id!r} is not a token id (a non-negative integer)",
                    hint,
                    param="logit_bias",
                )
            if not _is_finite_number(value):
                raise InvalidSamplingParamsError(
                    f"logit_bias[{token_id}] must be a finite number, got {value!r}",
                    hint,
                    param="logit_bias",
                )
            if not -_MAX_LOGIT_BIAS <= value <= _MAX_LOGIT_BIAS:
                raise InvalidSamplingParamsError(
                    f"logit_bias[{token_id}] must be in [-100, 100], got {value}",
                    "use -100 to ban a token, 100 to force it, or a value in between",
                    param="logit_bias",
                )

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
