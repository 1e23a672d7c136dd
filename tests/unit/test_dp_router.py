"""DPRouter: least outstanding work, prefix affinity unless much busier, dead and revived
replicas."""

import pytest

from llmctl.engine.dp.router import DPRouter
from llmctl.engine.errors import EngineDeadError

BS = 4


def prompt(seed: int, n: int = 8) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def test_requests_spread_over_the_least_loaded_replicas():
    router = DPRouter(3, BS)
    chosen = [router.route(f"r{i}", prompt(i), max_tokens=16) for i in range(6)]
    assert chosen == [0, 1, 2, 0, 1, 2]
    assert router.loads == [48, 48, 48]
    assert router.routed_count == [2, 2, 2]


def test_load_counts_prompt_then_tokens_left_and_drops_when_finished():
    router = DPRouter(2, BS)
    router.route("a", prompt(1, 100), max_tokens=20)
    assert router.loads == [120, 0]
    router.progress("a", generated=5)  # prefilled, 15 tokens may follow
    assert router.loads == [15, 0]
    router.progress("a", generated=25)  # never negative
    assert router.loads == [0, 0]
    router.finish("a")
    router.finish("a")  # twice (finished, then aborted by the caller) is harmless
    assert router.loads == [0, 0]


def test_a_long_request_sends_the_next_ones_elsewhere():
    router = DPRouter(2, BS)
    assert router.route("long", prompt(1, 400), max_tokens=100) == 0
    assert [router.route(f"s{i}", prompt(10 + i), max_tokens=10) for i in range(5)] == [1] * 5


def test_a_cached_prefix_prefers_its_replica():
    router = DPRouter(2, BS)
    shared = prompt(7, 12)  # three full blocks
    assert router.route("a", shared + [1], max_tokens=4) == 0
    # replica 0 is busier (17 tokens) but holds 12 tokens (worth 48) of the next prefix
    assert router.cached_tokens(shared + [2, 3]) == [12, 0]
    assert router.route("b", shared + [2, 3], max_tokens=4) == 0
    # a prompt without that prefix goes to the idle replica
    assert router.route("c", prompt(8), max_tokens=4) == 1


def test_a_partial_block_is_no_prefix():
    router = DPRouter(2, BS)
    router.route("a", [1, 2, 3], max_tokens=1)
    assert router.block_hashes([1, 2, 3]) == []
    assert router.route("b", [1, 2, 3], max_tokens=1) == 1


def test_prefix_affinity_gives_way_when_the_cached_replica_is_much_busier():
    router = DPRouter(2, BS)
    shared = prompt(7, 8)
    router.route("a", shared, max_tokens=4)  # replica 0 caches 8 tokens
    router.route("big", prompt(9, 4), max_tokens=500)  # replica 1, then more on 0:
    router.add("busy", 0, prompt(5, 8), max_tokens=600)
    # replica 0: 12 + 608 tokens outstanding, 1: 504; 8 cached tokens (worth 32) do not pay
    assert router.route("b", shared + [1], max_tokens=4) == 1


def test_prefixes_diverging_after_the_first_block_match_only_that_block():
    router = DPRouter(2, BS)
    router.route("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1)
    assert router.cached_tokens([1, 2, 3, 4, 9, 9, 9, 9]) == [4, 0]
    assert router.cached_tokens([9, 2, 3, 4, 5, 6, 7, 8]) == [0, 0]


def test_the_prefix_memory_is_bounded():
    router = DPRouter(2, BS, max_prefix_entries=2)
    router.route("a", prompt(1, 12), max_tokens=1)  # three blocks: the oldest is forgotten
    assert len(router._prefixes) == 2
    assert router.cached_tokens(prompt(1, 12)) == [0, 0]


def test_dead_replicas_get_nothing_and_none_left_is_a_typed_error():
    router = DPRouter(2, BS)
    shared = prompt(3)
    router.route("a", shared, max_tokens=1)
    router.mark_dead(0, "worker rank 0 (pid 12) was killed by SIGKILL")
    assert router.live == [1]
    assert router.route("b", shared, max_tokens=1) == 1
    router.mark_dead(1, "the engine thread stopped")
    with pytest.raises(EngineDeadError) as info:
        router.choose(shared)
    assert "replica 0: worker rank 0 (pid 12) was killed by SIGKILL" in str(info.value)
    assert "replica 1: the engine thread stopped" in str(info.value)


def test_a_revived_replica_is_routed_again_with_nothing_cached():
    router = DPRouter(2, BS)
    shared = prompt(3)
    assert router.route("a", shared, max_tokens=1) == 0
    router.mark_dead(0, "worker rank 0 (pid 12) was killed by SIGKILL")
    router.finish("a")  # its request failed
    assert router.route("b", shared, max_tokens=1) == 1
    router.revive(0)  # restarted: an empty cache, no load
    assert router.live == [0, 1] and router.dead == {}
    assert router.cached_tokens(shared) == [0, BS * 2]
    assert router.route("c", prompt(4), max_tokens=1) == 0  # replica 1 still holds "b"
