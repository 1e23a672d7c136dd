"""Data-parallel attention with expert-parallel MoE layers: LLM(data_parallel_size=2,
enable_expert_parallel=True) runs two replicas whose workers share one torch.distributed world,
the experts dealt over all DP x TP ranks, and gives Hugging Face's greedy tokens: a batch spread
over both replicas, one request alone (the other replica idles through dummy batches), tp=2 x
dp=2. A worker that dies stops every replica with an error naming the shared world; layouts it
does not support are refused before any process starts."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest
from support import MOE_FAMILIES, live_pids, random_prompts, token_ids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError, EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [3, 9, 17, 30, 5]
COMMON = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02)
DP_EP = dict(data_parallel_size=2, enable_expert_parallel=True, **COMMON)


def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_models, hf_greedy):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            _, hf_model = tiny_models.get(family)
            cache[family] = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts()]
        return cache[family]

    return get


def children() -> set[int]:
    return live_pids(parent=os.getpid())


def rank_infos(llm: LLM) -> list[list[dict]]:
    return [r.engine.executor.rank_info() for r in llm.engine_client.replicas]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_two_replicas_share_the_experts_and_match_transformers(
    family, tiny_models, expected, caplog
):
    """Replica 1 caches the 30-token prompt's first block (block 0), then idles through dummy
    batches while replica 0 decodes a request alone; the prompt again hits that block on
    replica 1 and still gives Hugging Face's tokens; then the whole batch, spread over both."""
    want = expected(family)
    short, _, _, long, other = prompts()
    before = children()
    with (
        caplog.at_level(logging.INFO, logger="llmctl"),
        LLM(str(tiny_models.path(family)), **DP_EP) as llm,
    ):
        # each replica's one worker holds half the experts: EP size 2 = DP 2 x TP 1
        weights = [info["weight_bytes"] for g in rank_infos(llm) for info in g]
        replica1 = llm.engine_client.replicas[1]
        assert token_ids(llm.generate([short, long], GREEDY, use_tqdm=False)) == [
            want[0],
            want[3],
        ]
        assert replica1.get_stats().prompt_tokens == len(long)  # the long one went there
        alone = token_ids(llm.generate([other], GREEDY, use_tqdm=False))
        assert replica1.get_stats().prompt_tokens == len(long)  # replica 1 only kept step
        again = token_ids(llm.generate([long], GREEDY, use_tqdm=False))
        assert replica1.get_stats().prefix_cache_hits >= 16  # its cached block, reused
        batch = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
    assert alone == [want[4]]
    assert again == [want[3]]
    assert batch == want
    assert "Expert parallel (EP size 2 = DP x TP)" in caplog.text
    with LLM(str(tiny_models.path(family)), **COMMON) as one:
        whole = one.llm_engine.executor.rank_info()[0]["weight_bytes"]
    assert max(weights) < whole  # no replica holds every expert
    assert children() <= before  # every worker of both replicas is gone


def test_tp2_x_dp2_matches_transformers(tiny_models, expected):
    """Four workers in one world: experts 0-1, 2-3, 4-5, 6-7 on global ranks 0-3."""
    with LLM(str(tiny_models.path("mixtral")), tensor_parallel_size=2, **DP_EP) as llm:
        infos = rank_infos(llm)
        assert [[info["rank"] for info in g] for g in infos] == [[0, 1], [0, 1]]
        assert len({info["pid"] for g in infos for info in g}) == 4
        batch = token_ids(llm.generate(prompts()[:3], GREEDY, use_tqdm=False))
        alone = token_ids(llm.generate(prompts()[4:], GREEDY, use_tqdm=False))
    assert batch == expected("mixtral")[:3]
    assert alone == expected("mixtral")[4:]


def test_the_triton_attention_path_matches_transformers(tiny_models, expected, monkeypatch):
    """The attention path CUDA takes (Triton's interpreter here): the idle replica's dummy
    batches write their key and value through reshape_and_cache into a scratch block."""
    monkeypatch.setenv("LLMCTL_ATTENTION_BACKEND", "triton")
    with LLM(str(tiny_models.path("mixtral")), **DP_EP) as llm:
        alone = token_ids(llm.generate(prompts()[1:2], GREEDY, use_tqdm=False))
        batch = token_ids(llm.generate(prompts()[:3], GREEDY, use_tqdm=False))
    assert alone == expected("mixtral")[1:2]
    assert batch == expected("mixtral")[:3]


def test_a_worker_dying_mid_stream_stops_every_replica(tiny_models):
    """The request decodes on replica 0 while replica 1 runs dummy batches; replica 1's worker
    is killed: the request fails at once (not after a collective's timeout), and neither
    replica serves on, each saying why."""
    before = children()
    llm = LLM(str(tiny_models.path("mixtral")), **DP_EP)
    dp = llm.engine_client
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def stream() -> tuple[int, float]:
        seen, killed = 0, 0.0
        with pytest.raises(EngineDeadError) as err:
            async for _ in dp.generate({"prompt_token_ids": prompts()[0]}, long, "r"):
                seen += 1
                if seen == 3:
                    os.kill(dp.replicas[1].engine.executor.pids[0], signal.SIGKILL)
                    killed = time.monotonic()
        assert "data-parallel replica 1 stopped" in err.value.message
        assert "was killed by SIGKILL" in err.value.message
        assert "share one expert-parallel world" in err.value.message
        return seen, time.monotonic() - killed

    try:
        seen, seconds = asyncio.run(stream())
        assert seen < 200 and seconds < 10
        states = dp.replica_states()
        assert "was killed by SIGKILL" in states[1][2].message
        assert "data-parallel replica 1 stopped" in states[0][2].message
        assert not dp.is_running
    finally:
        dp.shutdown()
    assert children() <= before


@pytest.mark.parametrize(
    "kwargs, message, hint",
    [
        (
            {"pipeline_parallel_size": 2},
            "does not support pipeline_parallel_size=2 yet",
            "drop --pipeline-parallel-size",
        ),
        (
            {"distributed_executor_backend": "ray"},
            "runs on the mp backend, not 'ray'",  # plain data parallel runs on Ray too
            "--distributed-executor-backend mp",
        ),
        (
            {"data_parallel_size_local": 1, "data_parallel_address": "127.0.0.1"},
            "runs every replica on this node",
            "drop --data-parallel-size-local",
        ),
        (
            {"tensor_parallel_size": 3, "data_parallel_size": 3},  # 9 ranks for 8 experts
            "expert parallelism over 9 ranks exceeds the model's 8 experts",
            "tensor_parallel_size x data_parallel_size",
        ),
    ],
)
def test_unsupported_layouts_are_refused_before_any_process(tiny_models, kwargs, message, hint):
    before = children()
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_models.path("mixtral")), **{**DP_EP, **kwargs})
    assert message in err.value.message
    assert hint in err.value.hint
    assert children() <= before


def test_restart_on_failure_is_refused_naming_the_shared_world():
    from llmctl.engine.config.engine_args import EngineArgs

    with pytest.raises(ConfigError) as err:
        EngineArgs(data_parallel_size=2, enable_expert_parallel=True, restart_on_failure=True)
    assert "share one torch.distributed world" in err.value.message
    assert "--restart-on-failure" in err.value.hint


def test_a_replica_whose_peer_fails_to_start_stops_at_once(tiny_models):
    """Replica 0 starts alone: its worker waits in the shared rendezvous for replica 1's, which
    never come. When the start fails elsewhere (DPLockstep.fail, as start_replicas calls it),
    replica 0's start ends at once with that error, its worker stopped, instead of waiting for
    the rendezvous timeout."""
    from llmctl.engine.config.engine_args import EngineArgs
    from llmctl.engine.core.llm_engine import LLMEngine
    from llmctl.engine.dp.dp_async_llm import replica_configs
    from llmctl.engine.dp.lockstep import DPLockstep

    before = children()
    args = EngineArgs(
        model=str(tiny_models.path("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        dtype="float32",
        kv_cache_space_gib=0.02,
    )
    configs = replica_configs(args.create_engine_config())
    port = configs[0].parallel_config.data_parallel_master_port
    assert port == configs[1].parallel_config.data_parallel_master_port  # one world
    lockstep = DPLockstep(2, port)

    def fail_once_started() -> None:
        deadline = time.monotonic() + 60
        while not lockstep._executors and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the condition, not a fixed wait
        lockstep.fail(EngineDeadError("it failed to start: replica 1's worker raised"))

    failer = threading.Thread(target=fail_once_started)
    failer.start()
    started = time.monotonic()
    try:
        with pytest.raises(EngineDeadError) as err:
            LLMEngine(configs[0])
    finally:
        failer.join()
        lockstep.close()
    assert "replica 1's worker raised" in err.value.message
    assert "share one expert-parallel world" in err.value.message
    assert time.monotonic() - started < 60
    assert children() <= before
