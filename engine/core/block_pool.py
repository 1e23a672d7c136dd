"""BlockPool: the paged KV cache's blocks and the prefix cache's names for them. Pure Python.

The cache is `num_blocks` blocks. A block is held by requests (ref_cnt > 0) or free. Free
blocks written before keep their name (a key: the KV cache group and a hash of the tokens up to
and including the block) and stay findable until they are evicted, least recently freed first.

Blocks never written yet are kept apart (`fresh`: the ids from `next_fresh` up, handed out lowest
first; their KVCacheBlock objects are made when first taken, so a pool of 262,144 blocks - a tiny
model's default CPU cache - starts in microseconds, not the second a list of them took). Where
the cache's memory is committed on first write (the CPU's KV cache is an anonymous map the kernel
fills as pages are touched), `reuse_written_first` takes a free block that was written before -
evicting the least recently freed cached one - ahead of a fresh one, so the resident set follows
the most KV in use at once, not every token the server has seen; the prefix cache then holds
what fits in that set. Without it (a GPU's cache is all allocated up front) fresh blocks go
first, keeping cached blocks longer.
"""

from __future__ import annotations

from collections import OrderedDict

# A block's name in the prefix cache: (KV cache group, block hash).
BlockKey = tuple[int, int]


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockKey | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, reuse_written_first: bool = False) -> None:
        self.num_blocks = num_blocks
        self.reuse_written_first = reuse_written_first
        self.blocks: list[KVCacheBlock] = []  # the blocks taken at least once, by id
        self.next_fresh = 0  # blocks next_fresh.. were never taken (never written)
        # Free blocks written before, least recently freed first (evicted first); cached
        # blocks are among them.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached: dict[BlockKey, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_fresh_blocks

    @property
    def num_fresh_blocks(self) -> int:
        return self.num_blocks - self.next_fresh

    @property
    def num_written_blocks(self) -> int:
        """Blocks written at least once: on the CPU, the KV cache's resident share."""
        return self.next_fresh

    def take(self) -> KVCacheBlock:
        """A free block for a request (ref_cnt 1), its old name dropped."""
        if self.next_fresh < self.num_blocks and not (self.reuse_written_first and self.free_queue):
            block = KVCacheBlock(self.next_fresh)
            self.blocks.append(block)
            self.next_fresh += 1
            block.ref_cnt = 1
            return block
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def touch(self, block: KVCacheBlock) -> None:
        """One more request holds `block` (a prefix-cache hit)."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def release(self, block: KVCacheBlock) -> None:
        """One request fewer holds `block`; free (and still findable) at zero."""
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = block

    def lookup(self, key: BlockKey) -> KVCacheBlock | None:
        return self.cached.get(key)

    def name(self, block: KVCacheBlock, key: BlockKey) -> None:
        """Make `block` findable as `key`, unless it has a name or `key` names another."""
        if block.block_hash is None and key not in self.cached:
            block.block_hash = key
            self.cached[key] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False  # blocks in use
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
