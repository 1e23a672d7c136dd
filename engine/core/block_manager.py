"""BlockManager: the paged KV cache's bookkeeping per request, with automatic prefix caching and
sliding-window freeing (vLLM's hybrid allocator). Pure Python.

A request owns one block table per KV cache group (config/kv_cache_layout.py): one group for a
model whose layers are all alike, several for one that mixes full and sliding-window attention.
Every group's blocks come from one BlockPool. With prefix caching, each full block is named by a
hash of its tokens and of the blocks before it (and its group); a new request whose prompt
starts with the same tokens reuses those blocks (reference-counted) instead of recomputing them.

In a group of sliding-window layers (window W), the query at position p sees keys p - W + 1 ..
p. Once a request has n tokens computed, no future query sees the keys before n - W + 1: their
blocks go back to the pool (still findable by their names until evicted) and the table keeps a
hole there (None; the workers' tables keep the old id, which their kernels never read: the
window masks it). A request of L tokens then holds about W tokens of each sliding group, not L.
A prefix hit in a sliding group needs only the blocks inside the window before the hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmctl.engine.core.block_pool import BlockPool, KVCacheBlock
from llmctl.engine.core.request import Request

_ROOT_HASH = 0x6C6C6D63746C  # parent of a request's first block
_LONG_ROPE_ROOT = _ROOT_HASH ^ 1  # ... of a request past a LongRoPE model's threshold
# What the workers' block tables hold for a hole: any valid block id; never read.
HOLE_BLOCK_ID = 0

# Per KV cache group, a request's blocks in order (None: freed, out of the window).
GroupBlocks = list[list[KVCacheBlock | None]]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        reuse_written_first: bool = False,
        sliding_windows: Sequence[int | None] = (None,),
        long_rope_threshold: int | None = None,
    ) -> None:
        """`sliding_windows`: each KV cache group's window (None: full attention).
        `long_rope_threshold`: a LongRoPE model's length past which a request's KV is computed
        with the long factors: its blocks are named apart from the short factors' ones."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(sliding_windows)
        self.long_rope_threshold = long_rope_threshold
        self.pool = BlockPool(num_blocks, reuse_written_first)
        self.req_blocks: dict[str, GroupBlocks] = {}
        self.req_num_hashed: dict[str, int] = {}  # leading blocks already named in the cache
        self.stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_written_blocks(self) -> int:
        """Blocks written at least once: on the CPU, the KV cache's resident share."""
        return self.pool.num_written_blocks

    @property
    def cached(self) -> dict:
        return self.pool.cached

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_held_blocks(self, request_id: str) -> int:
        return sum(b is not None for group in self.req_blocks.get(request_id, ()) for b in group)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, the request's block ids in order (holes as HOLE_BLOCK_ID)."""
        groups = self.req_blocks.get(request_id) or [[] for _ in self.windows]
        return [[HOLE_BLOCK_ID if b is None else b.block_id for b in g] for g in groups]

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Per group, the cached blocks that start this request's tokens (holes before a sliding
        group's window), and how many tokens they hold.

        The last token is never served from the cache: it must be computed to get logits.
        """
        if not self.enable_caching:
            return [[] for _ in self.windows], 0
        hashes = self._block_hashes(request)
        num_hits = (request.num_tokens - 1) // self.block_size
        for g, window in enumerate(self.windows):
            if window is None:
                num_hits = min(num_hits, self._cached_run(g, hashes, 0, num_hits))
        # The longest hit every sliding group has its window of blocks for.
        while num_hits and not all(
            self._cached_run(g, hashes, first, num_hits) == num_hits - first
            for g, first in self._window_starts(num_hits * self.block_size)
        ):
            num_hits -= 1
        hits: GroupBlocks = []
        starts = dict(self._window_starts(num_hits * self.block_size))
        for g in range(self.num_groups):
            first = starts.get(g, 0)
            blocks = [self.pool.lookup((g, h)) for h in hashes[first:num_hits]]
            hits.append([None] * first + blocks)
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hits * self.block_size
        return hits, num_hits * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> list[list[int]] | None:
        """Give `request` room for `num_new_tokens` more tokens after its computed ones (and
        the prefix-cache hits `new_computed_blocks`, as get_computed_blocks gave them).

        Returns, per group, the ids of the newly allocated blocks; or None (and allocates
        nothing) when there are not enough free blocks.
        """
        computed = new_computed_blocks or [[] for _ in self.windows]
        rid = request.request_id
        groups = self.req_blocks.get(rid)
        if groups is None:
            groups = [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + len(computed[0]) * self.block_size
        self._free_out_of_window(groups, request.num_computed_tokens)
        total = num_computed + num_new_tokens
        num_needed = [
            max(-(-total // self.block_size) - len(blocks) - len(hits), 0)
            for blocks, hits in zip(groups, computed, strict=True)
        ]
        # Cached hits that are currently free leave the free queue when this request takes them.
        held_hits = [b for hits in computed for b in hits if b is not None]
        free_hits = sum(1 for b in held_hits if b.ref_cnt == 0)
        if sum(num_needed) > self.num_free_blocks - free_hits:
            return None
        self.req_blocks[rid] = groups
        for block in held_hits:
            self.pool.touch(block)
        new_ids = []
        for blocks, hits, needed in zip(groups, computed, num_needed, strict=True):
            blocks.extend(hits)
            new = [self.pool.take() for _ in range(needed)]
            blocks.extend(new)
            new_ids.append([b.block_id for b in new])
        if computed[0]:
            self.req_num_hashed[rid] = len(groups[0])
        if self.enable_caching:
            self._cache_full_blocks(request, groups, total)
        return new_ids

    def free(self, request: Request) -> None:
        groups = self.req_blocks.pop(request.request_id, [])
        self.req_num_hashed.pop(request.request_id, None)
        # Tail blocks first, so that they are evicted before the shared prefix.
        for blocks in groups:
            for block in reversed(blocks):
                if block is not None:
                    self.pool.release(block)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # -- internals -------------------------------------------------------------------------------

    def _window_starts(self, num_computed: int) -> list[tuple[int, int]]:
        """(group, the first block a query after `num_computed` tokens sees) per sliding group."""
        out = []
        for g, window in enumerate(self.windows):
            if window is not None:
                out.append((g, max(num_computed - window + 1, 0) // self.block_size))
        return out

    def _free_out_of_window(self, groups: GroupBlocks, num_computed: int) -> None:
        """Return each sliding group's blocks that no query after `num_computed` tokens sees."""
        for g, first in self._window_starts(num_computed):
            blocks = groups[g]
            i = min(first, len(blocks)) - 1
            while i >= 0 and blocks[i] is not None:  # freed earlier: a hole already
                self.pool.release(blocks[i])
                blocks[i] = None
                i -= 1

    def _cached_run(self, group: int, hashes: list[int], start: int, end: int) -> int:
        """How many of blocks start, start + 1, ... (before `end`) are cached in `group`."""
        for i in range(start, end):
            if self.pool.lookup((group, hashes[i])) is None:
                return i - start
        return end - start

    def _cache_full_blocks(self, request: Request, groups: GroupBlocks, tokens: int) -> None:
        """Name the blocks that `tokens` tokens fill, so later requests can find them."""
        num_full = min(tokens, request.num_tokens) // self.block_size  # only known tokens
        rid = request.request_id
        start = self.req_num_hashed.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for g, blocks in enumerate(groups):
            for i in range(start, num_full):
                if blocks[i] is not None:
                    self.pool.name(blocks[i], (g, hashes[i]))
        self.req_num_hashed[rid] = num_full

    def _block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        threshold = self.long_rope_threshold
        root = _ROOT_HASH
        if threshold is not None and len(tokens) > threshold:
            root = _LONG_ROPE_ROOT  # (the scheduler clears the hashes when a request crosses)
        while (len(hashes) + 1) * size <= len(tokens):
            parent = hashes[-1] if hashes else root
            i = len(hashes)
            hashes.append(hash((parent, tuple(tokens[i * size : (i + 1) * size]))))
        return hashes
