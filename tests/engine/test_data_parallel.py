"""Data parallel offline: LLM(data_parallel_size=2) runs two replicas, each its own worker
process and KV cache, and a batch gets the same greedy tokens as one engine."""

from __future__ import annotations

import os

import pytest
import torch
from support import VOCAB, live_pids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError, InvalidRequestError, RequestBatchError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9, 33, 5, 20)]


def greedy(llm: LLM, batch) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def test_two_replicas_give_one_engines_tokens(tiny_models):
    path = str(tiny_models.path("llama"))
    common = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02)
    with LLM(path, **common) as llm:
        expected = greedy(llm, prompts())
    before = live_pids(parent=os.getpid())
    with LLM(path, data_parallel_size=2, **common) as llm:
        replicas = llm.engine_client.replicas
        pids = [p for r in replicas for p in r.engine.executor.pids]
        assert len(set(pids)) == 2  # one worker process per replica (tp=1, pp=1)
        assert greedy(llm, prompts()) == expected
        # both replicas took requests, and each has its own KV cache
        assert all(r.get_stats().prompt_tokens > 0 for r in replicas)
        assert replicas[0].engine.scheduler is not replicas[1].engine.scheduler
        # a bad prompt fails alone, as with one engine
        with pytest.raises(RequestBatchError) as err:
            llm.generate([prompts()[0], [VOCAB + 5]], GREEDY, use_tqdm=False)
        assert err.value.outputs[0].outputs[0].token_ids == expected[0]
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            llm.generate([[VOCAB + 5]], GREEDY, use_tqdm=False)
    assert live_pids(parent=os.getpid()) <= before  # every replica's worker is gone


def test_replicas_of_two_tensor_parallel_ranks_each(tiny_models):
    """dp=2 x tp=2: four workers, each replica its own Gloo group (its own port), same tokens."""
    path = str(tiny_models.path("llama"))
    common = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02)
    batch = prompts()[:4]
    with LLM(path, **common) as llm:
        expected = greedy(llm, batch)
    with LLM(path, data_parallel_size=2, tensor_parallel_size=2, **common) as llm:
        groups = [r.engine.executor.rank_info() for r in llm.engine_client.replicas]
        assert [[info["rank"] for info in g] for g in groups] == [[0, 1], [0, 1]]
        assert len({info["pid"] for g in groups for info in g}) == 4
        assert greedy(llm, batch) == expected


def test_replicas_on_the_ray_backend_share_one_ray_and_outlive_each_other(tiny_models):
    """dp=2 on Ray: each replica its own placement group and actor, one Ray for both (started
    here, a CPU per rank); one replica's executor stopping leaves the other serving, and Ray
    goes down with the last."""
    ray = pytest.importorskip("ray")
    path = str(tiny_models.path("llama"))
    common = dict(use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02)
    batch = prompts()[:4]
    with LLM(path, **common) as llm:
        expected = greedy(llm, batch)
    assert not ray.is_initialized()
    with LLM(path, data_parallel_size=2, distributed_executor_backend="ray", **common) as llm:
        executors = [r.engine.executor for r in llm.engine_client.replicas]
        assert [type(e).__name__ for e in executors] == ["RayExecutor", "RayExecutor"]
        assert executors[0].placement_group.id != executors[1].placement_group.id
        assert len({pid for e in executors for pid in e.pids}) == 2
        assert ray.cluster_resources()["CPU"] >= 2
        assert greedy(llm, batch) == expected
        assert all(r.get_stats().prompt_tokens > 0 for r in llm.engine_client.replicas)
        executors[0].shutdown()  # as a failed replica's executor is stopped before a restart
        assert ray.is_initialized()
        assert ray.get(executors[1].actors[0].node_ip.remote())  # its actor still answers
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "kwargs, message, hint",
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be a positive integer", None),
        (
            {"data_parallel_size": 2, "distributed_executor_backend": "uni"},
            "the uni backend cannot",
            "--distributed-executor-backend mp",
        ),
        (
            {
                "data_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "nnodes": 2,
                "master_addr": "127.0.0.1",
            },  # fmt: skip
            "--data-parallel-size with --nnodes: multi-node data parallel is not yet",
            "this node",
        ),
        (
            {"data_parallel_size": 2, "data_parallel_size_local": 1},
            "--data-parallel-size-local 1 of --data-parallel-size 2 places replicas on several "
            "nodes, but no head address is given",
            "add --data-parallel-address",
        ),
    ],
)
def test_bad_data_parallel_settings_refused_before_any_process(tiny_models, kwargs, message, hint):
    before = live_pids(parent=os.getpid())
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, **kwargs)
    assert message in err.value.message
    if hint:
        assert hint in err.value.hint
    assert live_pids(parent=os.getpid()) <= before


def test_a_shared_prefix_follows_its_replica(tiny_models):
    """Prompts sharing two full KV blocks go to the replica that has them; the others spread."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, VOCAB, (32,), generator=g).tolist()  # two blocks of 16
    with LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, data_parallel_size=2,
             kv_cache_space_gib=0.02) as llm:  # fmt: skip
        router = llm.engine_client.router
        llm.generate([shared + [1]], GREEDY, use_tqdm=False)  # replica 0 caches the prefix
        assert router.routed_count == [1, 0]
        llm.generate([shared + [2], shared + [3, 4]], GREEDY, use_tqdm=False)
        assert router.routed_count == [3, 0]
        replica0 = llm.engine_client.replicas[0].get_stats()
        assert replica0.prefix_cache_hits >= 2 * 32  # both found the prefix in its KV cache
        llm.generate(prompts()[:2], GREEDY, use_tqdm=False)  # no shared prefix: spread
        assert router.routed_count == [4, 1]
