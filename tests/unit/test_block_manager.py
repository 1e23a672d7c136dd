"""BlockManager: allocation, freeing, prefix-cache hits and eviction. Pure Python."""

from __future__ import annotations

from llmctl.engine.core.block_manager import BlockManager
from llmctl.engine.core.request import Request
from llmctl.engine.sampling_params import SamplingParams


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), frozenset(), max_tokens=16)


def test_allocates_blocks_for_tokens_and_frees_them():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = request("a", list(range(10)))
    assert bm.allocate_slots(r, 10) == [[0, 1, 2]]
    assert bm.num_free_blocks == 7
    r.num_computed_tokens = 10
    assert bm.allocate_slots(r, 2) == [[]]  # slots 10 and 11 fit in block 2
    r.num_computed_tokens = 12
    assert bm.allocate_slots(r, 1) == [[3]]
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
    assert (blocks, hit) == ([[]], 0)
    bm.allocate_slots(a, 9)
    b = request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    blocks, hit = bm.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks[0]] == bm.block_ids("a")[0][:2]
    new = bm.allocate_slots(b, 2, blocks)
    assert len(new[0]) == 1
    assert [x.ref_cnt for x in blocks[0]] == [2, 2]
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
    assert bm.get_computed_blocks(request("b", list(range(9)))) == ([[]], 0)
    assert not bm.cached


def test_written_blocks_are_reused_before_fresh_ones_where_memory_is_committed_on_write():
    """The CPU's policy: a single stream keeps reusing the blocks it wrote (its resident set
    stays put), a prefix it just used is still found, and fresh blocks are taken only when more
    KV is in use at once than was ever written."""
    bm = BlockManager(num_blocks=8, block_size=4, reuse_written_first=True)
    a = request("a", list(range(9)))  # 3 blocks
    bm.allocate_slots(a, 9)
    bm.free(a)
    assert bm.num_written_blocks == 3 and bm.num_free_blocks == 8
    b = request("b", list(range(100, 109)))  # another 3 blocks: a's, not fresh ones
    assert sorted(bm.allocate_slots(b, 9)[0]) == [0, 1, 2]
    assert bm.num_written_blocks == 3
    b_blocks = bm.block_ids("b")[0]
    bm.free(b)
    c = request("c", list(range(100, 108)) + [7, 7])  # b's first two blocks are cached
    hits, tokens = bm.get_computed_blocks(c)
    assert tokens == 8 and [x.block_id for x in hits[0]] == b_blocks[:2]
    bm.allocate_slots(c, 2, hits)
    assert bm.num_written_blocks == 3
    # c holds all 3 written blocks (its third evicted b's last one): d's 4 must be fresh
    d = request("d", list(range(200, 213)))
    assert sorted(bm.allocate_slots(d, 13)[0]) == [3, 4, 5, 6]
    assert bm.num_written_blocks == 7 and bm.num_free_blocks == 1


def test_fresh_blocks_go_first_by_default_keeping_cached_blocks_longer():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = request("a", list(range(9)))
    bm.allocate_slots(a, 9)
    bm.free(a)
    b = request("b", list(range(100, 109)))
    assert bm.allocate_slots(b, 9) == [[3, 4, 5]]
    assert bm.get_computed_blocks(request("a2", list(range(9))))[1] == 8  # a's still cached


# -- KV cache groups with sliding windows (vLLM's hybrid allocator) -----------------------------


def test_a_sliding_group_frees_blocks_behind_its_window():
    # Group 0 full attention, group 1 a window of 6 tokens; blocks of 4.
    bm = BlockManager(num_blocks=40, block_size=4, sliding_windows=(None, 6))
    r = request("a", list(range(20)))
    assert bm.allocate_slots(r, 20) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # the prefill: all
    r.num_computed_tokens = 20
    # The next query (position 20) sees keys 15..20: blocks 3 and up; 0, 1, 2 go back.
    assert bm.allocate_slots(r, 1) == [[10], [11]]
    assert bm.block_ids("a")[1] == [0, 0, 0, 8, 9, 11]  # holes read as block 0 by the workers
    assert bm.num_held_blocks("a") == 6 + 3
    assert bm.num_free_blocks == 40 - 9
    bm.free(r)
    assert bm.num_free_blocks == 40 and bm.usage == 0.0


def test_the_capacity_gain_of_freeing_sliding_blocks():
    """8 requests of 40-token prompts decoding to 64 tokens in 2 groups (blocks of 16): at most
    64 blocks held at once if every block is kept, 48 with a window of 12 (the prefill's 3 + 3;
    then 4 full and at most 2 sliding blocks each)."""
    for windows, most in (((None, None), 64), ((None, 12), 48)):
        bm = BlockManager(num_blocks=100, block_size=16, sliding_windows=windows)
        reqs = [request(str(i), list(range(64))) for i in range(8)]
        peak = 0
        for r in reqs:
            bm.allocate_slots(r, 40)
            r.num_computed_tokens = 40
        for n in range(40, 64):
            for r in reqs:
                assert bm.allocate_slots(r, 1) is not None
                r.num_computed_tokens = n + 1
                peak = max(peak, 100 - bm.num_free_blocks)
        peak = max(peak, 100 - bm.num_free_blocks)
        assert peak == most


def test_a_prefix_hit_in_a_sliding_group_needs_only_the_window_before_it():
    bm = BlockManager(num_blocks=40, block_size=4, sliding_windows=(None, 6))
    a = request("a", list(range(17)))
    bm.allocate_slots(a, 17)
    bm.free(a)
    b = request("b", list(range(16)) + [99, 98])
    hits, tokens = bm.get_computed_blocks(b)
    # 16 tokens hit: every full block, and in the sliding group the blocks holding 11..15
    assert tokens == 16
    assert [x is None for x in hits[1]] == [True, True, False, False]
    new = bm.allocate_slots(b, 2, hits)
    assert [len(ids) for ids in new] == [1, 1]  # token 16 and 17's block in each group
    assert bm.block_ids("b")[1][:2] == [0, 0] and bm.num_held_blocks("b") == 5 + 3


def test_a_sliding_hit_whose_window_was_evicted_is_shorter():
    bm = BlockManager(num_blocks=12, block_size=4, sliding_windows=(None, 6))
    a = request("a", list(range(17)))
    bm.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    bm.allocate_slots(a, 1)  # frees the sliding group's blocks 0..2 (window from token 12)
    bm.free(a)
    # Take the free blocks a's sliding group gave back first (least recently freed).
    taker = request("t", list(range(100, 112)))
    bm.allocate_slots(taker, 12)
    _, tokens = bm.get_computed_blocks(request("b", list(range(16)) + [99]))
    assert tokens < 16


def test_long_rope_requests_name_their_blocks_apart():
    bm = BlockManager(num_blocks=20, block_size=4, long_rope_threshold=10)
    short = request("s", list(range(9)))
    bm.allocate_slots(short, 9)
    bm.free(short)
    # the same first 8 tokens, but 12 tokens long: its KV has the long factors, no hit
    assert bm.get_computed_blocks(request("l", list(range(12))))[1] == 0
    assert bm.get_computed_blocks(request("s2", list(range(9))))[1] == 8


def test_a_large_pool_makes_a_block_only_when_it_is_first_taken():
    """A tiny model's default CPU cache is 262,144 blocks: the pool starts without an object per
    block (a list of them took a second of every engine start) and hands fresh ids out lowest
    first, then reuses released ones."""
    from llmctl.engine.core.block_pool import BlockPool

    pool = BlockPool(1 << 18, reuse_written_first=True)
    assert pool.num_free_blocks == 1 << 18 and pool.num_written_blocks == 0
    assert pool.blocks == []
    taken = [pool.take() for _ in range(3)]
    assert [b.block_id for b in taken] == [0, 1, 2] and pool.blocks == taken
    pool.release(taken[1])
    assert pool.take() is taken[1]  # written before: reused ahead of a fresh block
    assert pool.take().block_id == 3 and pool.num_written_blocks == 4
    assert pool.num_free_blocks == (1 << 18) - 4
