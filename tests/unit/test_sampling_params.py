"""SamplingParams refuses what it cannot sample with: NaN, infinities, bools as ints, bad biases."""

from __future__ import annotations

import math
import pickle

import pytest

from llmctl.engine import SamplingParams
from llmctl.engine.errors import InvalidSamplingParamsError

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_fields_must_be_finite(field, value):
    with pytest.raises(InvalidSamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert err.value.message == f"{field} must be a finite number, got {value!r}"
    assert err.value.hint


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_fields_are_numbers(field):
    for value in ("0.5", True, None):
        with pytest.raises(InvalidSamplingParamsError) as err:
            SamplingParams(**{field: value})
        assert err.value.param == field


@pytest.mark.parametrize(
    "field, value",
    [("n", True), ("top_k", True), ("max_tokens", False), ("min_tokens", True), ("seed", True),
     ("logprobs", True), ("n", 2.0), ("max_tokens", 3.5)],
)  # fmt: skip
def test_integer_fields_refuse_bools_and_floats(field, value):
    with pytest.raises(InvalidSamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert f"{field} must be an integer" in err.value.message


def test_stop_token_ids_must_be_integers():
    with pytest.raises(InvalidSamplingParamsError) as err:
        SamplingParams(stop_token_ids=[2, True])
    assert err.value.param == "stop_token_ids"


def test_finite_values_in_range_still_pass():
    params = SamplingParams(
        temperature=0,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=-2,
        frequency_penalty=2.0,
        repetition_penalty=1.1,
        max_tokens=None,
        seed=0,
        logprobs=0,
        top_k=-1,
    )
    assert params.greedy and params.top_k == 0


@pytest.mark.parametrize(
    "bias, wrong",
    [
        ({1: math.nan}, "logit_bias[1] must be a finite number, got nan"),
        ({1: math.inf}, "logit_bias[1] must be a finite number, got inf"),
        ({1: "5"}, "logit_bias[1] must be a finite number, got '5'"),
        ({1: 100.5}, "logit_bias[1] must be in [-100, 100], got 100.5"),
        ({1: -101}, "logit_bias[1] must be in [-100, 100], got -101"),
        ({-1: 5}, "logit_bias key -1 is not a token id"),
        ({"50256": 5}, "logit_bias key '50256' is not a token id"),
        ({True: 5}, "logit_bias key True is not a token id"),
        ([(1, 5)], "logit_bias must be a dict of token id to bias, got list"),
    ],
)
def test_logit_bias_is_validated(bias, wrong):
    with pytest.raises(InvalidSamplingParamsError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias"
    assert err.value.message.startswith(wrong)
    assert err.value.hint


def test_logit_bias_survives_replace_and_pickle():
    params = SamplingParams(logit_bias={7: -100, 9: 2})
    assert params.logit_bias == {7: -100.0, 9: 2.0}
    assert params.replace(n=2).logit_bias == params.logit_bias
    # Workers receive SamplingParams pickled, inside the scheduler's output.
    assert pickle.loads(pickle.dumps(params)) == params
    assert SamplingParams(logit_bias={}).logit_bias is None  # nothing to apply
    assert SamplingParams(logit_bias={1: -100, 2: 100}).logit_bias == {1: -100.0, 2: 100.0}
