"""logit_bias, as the OpenAI API and vLLM define it: a bias added to chosen tokens' logits."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import InvalidRequestError

PROMPT = [412, 77, 9031, 15, 2048, 661, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_models):
    path, hf_model = tiny_models.get("llama")
    llm = LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.02,
        max_model_len=64,
    )
    return llm, hf_model


def test_plus_100_forces_the_token_without_touching_other_rows(llama, hf_greedy):
    llm, hf_model = llama
    forced = 1234
    biased = GREEDY.replace(logit_bias={forced: 100})
    outputs = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [biased, biased.replace(temperature=1.0, seed=3), GREEDY],
        use_tqdm=False,
    )
    assert outputs[0].outputs[0].token_ids == [forced] * 8  # greedy
    assert outputs[1].outputs[0].token_ids == [forced] * 8  # sampled
    assert outputs[2].outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 8)  # no bias leaks


def test_minus_100_equals_transformers_suppress_tokens(llama, hf_greedy):
    llm, hf_model = llama
    banned = hf_greedy(hf_model, PROMPT, 1)[0]
    out = llm.generate(PROMPT, GREEDY.replace(logit_bias={banned: -100}), use_tqdm=False)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            suppress_tokens=[banned],
        )[0, len(PROMPT) :].tolist()
    assert banned not in expected
    assert out[0].outputs[0].token_ids == expected


def test_logprobs_report_the_unbiased_distribution(llama, hf_greedy):
    llm, hf_model = llama
    banned = hf_greedy(hf_model, PROMPT, 1)[0]
    params = GREEDY.replace(max_tokens=1, logprobs=5)
    plain, biased = llm.generate(
        [PROMPT, PROMPT], [params, params.replace(logit_bias={banned: -100})], use_tqdm=False
    )
    plain_lp, biased_lp = plain.outputs[0].logprobs[0], biased.outputs[0].logprobs[0]
    assert biased_lp == plain_lp  # the same top 5, same values, ranks and decoded text
    runner_up = next(t for t, lp in plain_lp.items() if lp.rank == 2)
    assert biased.outputs[0].token_ids == [runner_up]
    assert plain_lp[banned].rank == 1


def test_token_id_outside_the_vocabulary_is_refused(llama):
    llm, _ = llama
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(PROMPT, GREEDY.replace(logit_bias={5: 1.0, VOCAB: -100}), use_tqdm=False)
    assert err.value.param == "logit_bias"
    assert str(VOCAB) in err.value.message and "vocabulary" in err.value.message
    assert not llm.llm_engine.has_unfinished_requests()
