"""Sampling as a user sees it: seeds reproduce, stops end the text, logprobs are right."""

from __future__ import annotations

import math

import pytest
import torch
from support import VOCAB

from llmctl.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_models):
    path, hf_model = tiny_models.get("llama")
    return LLM(
        str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05
    ), hf_model


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_seeded_request_reproduces_whatever_the_batch(llama):
    llm, _ = llama
    target = prompts_of([11])[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts_of([5, 20, 33], seed=9)
    mixed = llm.generate(
        others + [target],
        [SamplingParams(temperature=1.0, max_tokens=24)] * 3 + [params],
        use_tqdm=False,
    )
    assert mixed[3].outputs[0].token_ids == alone
    # A different seed gives a different sample (24 tokens from a 49k vocabulary).
    other_seed = llm.generate([target], params.replace(seed=99), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy(llama):
    llm, _ = llama
    prompts = prompts_of([4, 9, 15])
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    top1 = llm.generate(
        prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=20), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_stop_string_ends_the_text_and_is_not_included(llama):
    llm, _ = llama
    prompt = prompts_of([10], seed=4)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < 32


def test_stop_token_id_ends_generation(llama):
    llm, _ = llama
    prompt = prompts_of([10], seed=5)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    ids = full[0].outputs[0].token_ids
    stop_id = ids[6]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    first = ids.index(stop_id)
    assert out.token_ids == ids[: first + 1]  # the stop token is in the ids...
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(ids[:first], skip_special_tokens=True)  # ...not the text


def test_min_tokens_holds_off_stop_tokens(llama):
    llm, _ = llama
    prompt = prompts_of([10], seed=5)[0]
    ids = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_id = ids[1]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id], min_tokens=12),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 12
    assert stop_id not in out.token_ids[:11]


def test_logprobs_match_transformers(llama):
    llm, hf_model = llama
    prompt = prompts_of([13], seed=6)[0]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=5), use_tqdm=False
    )[0].outputs[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert len(out.logprobs) == 8
    cumulative = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        reference = torch.log_softmax(gen.logits[step][0].float(), dim=-1)
        top = reference.topk(5)
        assert list(entry)[:5] == top.indices.tolist()
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - reference[token_id].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the most likely token
        cumulative += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, cumulative, rel_tol=1e-6)


def test_repetition_penalty_matches_transformers(llama):
    llm, hf_model = llama
    prompt = prompts_of([12], seed=7)[0]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.8, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert out.token_ids == ref


def test_frequency_and_presence_penalties_reduce_repetition(llama):
    llm, _ = llama
    prompt = prompts_of([6], seed=8)[0]
    plain = (
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    penalized = (
        llm.generate(
            [prompt],
            SamplingParams(
                temperature=0,
                max_tokens=48,
                ignore_eos=True,
                frequency_penalty=2.0,
                presence_penalty=2.0,
            ),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(plain)) < 48  # the tiny random model repeats itself...
    assert len(set(penalized)) > len(set(plain))  # ...and the penalties push it elsewhere


def test_n_completions_and_their_seeds(llama):
    llm, _ = llama
    prompt = prompts_of([8], seed=10)[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=42, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 3
    assert samples == [tuple(c.token_ids) for c in again.outputs]


def test_unseeded_sampling_follows_the_engine_seed(tiny_models):
    path = tiny_models.path("gpt2")
    prompt = prompts_of([8], seed=11)[0]
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def sample(seed: int) -> list[int]:
        llm = LLM(
            str(path), use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02, seed=seed
        )
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)


def test_top_p_and_min_p_keep_only_likely_tokens(llama):
    llm, hf_model = llama
    prompt = prompts_of([9], seed=12)[0]
    # With top_p tiny, only the most likely token survives: the same as greedy.
    nucleus = llm.generate(
        [prompt], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12), use_tqdm=False
    )
    min_p = llm.generate(
        [prompt], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12), use_tqdm=False
    )
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert nucleus[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert min_p[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
