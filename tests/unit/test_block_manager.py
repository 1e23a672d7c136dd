"""BlockManager: allocation, freeing, prefix-cache hits and eviction. Pure Python."""

from __future__ import annotations

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.request import Request
from llmctl.engine.sampling_params import SamplingParams


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), frozenset(), max_tokens=16)


def test_allocates_blocks_for_tokens_and_frees_them():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = request("a", list(range(10)))
    assert bm.allocate_slots(r, 10) == [0, 1, 2]
    assert bm.num_free_blocks == 7
    r.num_computed_tokens = 10
    assert bm.allocate_slots(r, 2) == []  # slots 10 and 11 fit in block 2
    r.num_computed_tokens = 12
    assert bm.allocate_slots(r, 1) == [3]
    bm.free(r)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0


def test_refuses_without_changing_anything():
    bm = BlockManager(num_blocks=3, block_size=4)
    r = request("a", list(range(13)))
    assert bm.allocate_slots(r, 13) is None
    assert bm.num_free_blocks == 3 and "a" not in bm.req_blocks


def test_shared_prefix_is_found_and_refcounted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks, hit = bm.get_computed_blocks(a)
    assert (blocks, hit) == ([], 0)
    bm.allocate_slots(a, 9)
    b = request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    blocks, hit = bm.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks] == bm.block_ids("a")[:2]
    new = bm.allocate_slots(b, 2, blocks)
    assert len(new) == 1
    assert [x.ref_cnt for x in blocks] == [2, 2]
    assert bm.stats.hits == 8 and bm.stats.queries == 19


def test_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate_slots(a, 8)
    same = request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    _, hit = bm.get_computed_blocks(same)
    assert hit == 4  # the second block holds the last token, which must be recomputed


def test_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = request("a", list(range(9)))
    bm.allocate_slots(a, 9)
    bm.free(a)
    assert bm.num_free_blocks == 4
    _, hit = bm.get_computed_blocks(request("b", list(range(9))))
    assert hit == 8
    # Filling the whole cache with other tokens evicts them.
    c = request("c", list(range(100, 116)))
    bm.allocate_slots(c, 16)
    bm.free(c)
    _, hit = bm.get_computed_blocks(request("d", list(range(9))))
    assert hit == 0


def test_tail_blocks_are_evicted_before_the_prefix():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = request("a", [1, 2, 3, 4, 5, 6, 7])
    bm.allocate_slots(a, 7)
    bm.free(a)
    taker = request("t", [50, 51])
    bm.allocate_slots(taker, 2)  # takes one free block: must be a's last one
    _, hit = bm.get_computed_blocks(request("b", [1, 2, 3, 4, 5, 6, 9]))
    assert hit == 6


def test_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=False)
    a = request("a", list(range(9)))
    bm.allocate_slots(a, 9)
    assert bm.get_computed_blocks(request("b", list(range(9)))) == ([], 0)
    assert not bm.cached
