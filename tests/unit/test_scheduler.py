"""Scheduler: token budget, chunked prefill, admission limits, preemption and stop checks."""

from __future__ import annotations

from llmctl.engine.config.engine_config import CacheConfig, SchedulerConfig
from llmctl.engine.core.model_runner_output import ModelRunnerOutput
from llmctl.engine.core.request import Request, RequestStatus
from llmctl.engine.core.scheduler import Scheduler
from llmctl.engine.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, max_len=64, caching=True):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
    )


def req(rid, n_prompt, max_tokens=8, **params):
    tokens = [100 + i for i in range(n_prompt)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, tokens, sp, frozenset({EOS}), max_tokens=max_tokens)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens >= r.num_tokens:
            sampled[rid] = token
    return out, s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def test_prefill_then_decode():
    s = make()
    s.add_request(req("a", 10))
    out, core = step(s)
    assert out.num_scheduled_tokens == {"a": 10}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    assert core[0].new_token_ids == [7]
    out, _ = step(s, token=8)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs[0].new_token_ids == [7]  # the diff: the token just sampled


def test_chunked_prefill_within_budget():
    s = make(budget=16)
    s.add_request(req("long", 40))
    s.add_request(req("short", 3))
    out, core = step(s)
    assert out.num_scheduled_tokens == {"long": 16}
    assert core == []  # no token until the whole prompt is computed
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"long": 16}
    out, core = step(s)
    assert out.num_scheduled_tokens == {"long": 8, "short": 3}
    assert {c.request_id for c in core} == {"long", "short"}


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 4))
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"0", "1"}
    assert [r.request_id for r in s.waiting] == ["2"]


def test_preempts_the_newest_and_resumes_it_with_its_tokens():
    # 4 blocks of 4 slots: two 7-token prompts fit in 2 blocks each; token 9 needs a 3rd.
    s = make(num_blocks=4, block_size=4, caching=False)
    s.add_request(req("old", 7, max_tokens=6))
    s.add_request(req("new", 7, max_tokens=6))
    step(s)  # both prefilled and sampled a token: 8 tokens each, 7 in the cache
    step(s)  # the 8th token's KV goes to slot 7, still in block 2; a 9th token is sampled
    assert s.num_preemptions == 0
    out, _ = step(s)  # both need a 3rd block for slot 8: "new" is preempted
    assert s.num_preemptions == 1
    assert list(out.num_scheduled_tokens) == ["old"]
    victim = s.waiting[0]
    assert victim.request_id == "new" and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.output_token_ids == [7, 7]
    while "old" in s.requests:
        step(s)
    out, _ = step(s)
    resumed = out.scheduled_new_reqs[0]
    assert resumed.req_id == "new"
    assert resumed.token_ids == [100 + i for i in range(7)] + [7, 7]  # prompt + its output


def test_stops_on_eos_stop_ids_and_length():
    s = make()
    s.add_request(req("eos", 3))
    s.add_request(req("stop", 3, stop_token_ids=[9]))
    s.add_request(req("len", 3, max_tokens=2))
    out = s.schedule()
    sampled = {"eos": EOS, "stop": 9, "len": 5}
    core = {c.request_id: c for c in s.update_from_output(out, ModelRunnerOutput(sampled))}
    assert core["eos"].finish_reason == "stop" and core["eos"].stop_reason is None
    assert core["stop"].finish_reason == "stop" and core["stop"].stop_reason == 9
    assert core["len"].finish_reason is None
    _, core = step(s, token=5)
    assert core[0].request_id == "len" and core[0].finish_reason == "length"
    assert not s.has_unfinished_requests()
    assert s.block_manager.usage == 0


def test_min_tokens_and_ignore_eos():
    s = make()
    s.add_request(req("min", 3, min_tokens=2))
    s.add_request(req("ign", 3, ignore_eos=True))
    out = s.schedule()
    core = s.update_from_output(out, ModelRunnerOutput({"min": EOS, "ign": EOS}))
    assert [c.finish_reason for c in core] == [None, None]


def test_max_model_len_caps_generation():
    s = make(max_len=12)
    s.add_request(req("a", 10, max_tokens=50))
    _, core = step(s)
    assert core[0].finish_reason is None
    _, core = step(s)
    assert core[0].finish_reason == "length"  # 12 tokens: the model's limit


def test_abort_tells_workers_and_frees():
    s = make()
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.finished_req_ids == {"a"}
    assert list(out.num_scheduled_tokens) == ["b"]


def test_in_flight_requests_are_not_rescheduled():
    s = make()
    s.add_request(req("a", 5))
    first = s.schedule()
    second = s.schedule()  # a pipelined second batch while the first is in flight
    assert first.num_scheduled_tokens == {"a": 5} and second.num_scheduled_tokens == {}
    s.update_from_output(first, ModelRunnerOutput({"a": 7}))
    assert s.schedule().num_scheduled_tokens == {"a": 1}


def test_prefix_cache_hit_reported_once():
    s = make()
    s.add_request(req("a", 9))
    step(s)
    s.add_request(req("b", 9))
    out, _ = step(s)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 1
    assert s.get_stats().prefix_cache_hits == 8


def test_pipelined_batches_share_out_the_requests():
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, max_concurrent_batches=2),
        CacheConfig(block_size=4),
        64,
    )
    for i in range(5):
        s.add_request(req(str(i), 4))
    first = s.schedule()
    second = s.schedule()  # while the first batch is in flight on the first stage
    assert list(first.num_scheduled_tokens) == ["0", "1", "2"]
    assert list(second.num_scheduled_tokens) == ["3", "4"]
    assert s.schedule().num_scheduled_tokens == {}  # every request is in flight


def test_a_long_rope_request_is_computed_again_when_it_grows_past_the_threshold():
    """Phi-3's LongRoPE: past original_max_position_embeddings (here 12) the request's KV must
    have the long factors, so the scheduler sends it back to be computed whole, once."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=4),
        64,
        long_rope_threshold=12,
    )
    s.add_request(req("a", 10, max_tokens=6))
    scheduled = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        scheduled.append(out.num_scheduled_tokens["a"])
    # prompt, 2 decodes (to 12 tokens), then 13 tokens again at once, then the last decodes
    assert scheduled == [10, 1, 1, 13, 1, 1]
    assert s.num_preemptions == 0
