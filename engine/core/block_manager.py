"""BlockManager: the paged KV cache's bookkeeping, with automatic prefix caching. Pure Python.

The cache is `num_blocks` blocks of `block_size` token slots. A request owns a list of blocks (its
block table). With prefix caching, each full block is named by a hash of its tokens and of the
blocks before it; a new request whose prompt starts with the same tokens reuses those blocks
(reference-counted) instead of recomputing them. Freed blocks keep their hash and stay findable
until they are evicted, least recently freed first.

Blocks never written yet are kept apart (`fresh`). Where the cache's memory is committed on first
write (the CPU's KV cache is an anonymous map the kernel fills as pages are touched),
`reuse_written_first` takes a free block that was written before - evicting the least recently
freed cached one - ahead of a fresh one, so the resident set follows the most KV in use at once,
not every token the server has seen; the prefix cache then holds what fits in that set. Without
it (a GPU's cache is all allocated up front) fresh blocks go first, keeping cached blocks longer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from llmctl.engine.core.request import Request

_ROOT_HASH = 0x6C6C6D63746C  # parent of a request's first block


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


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
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.reuse_written_first = reuse_written_first
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.fresh: deque[int] = deque(range(num_blocks))  # never written, lowest id first
        # Free blocks written before, least recently freed first (evicted first); cached
        # blocks are among them.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_num_hashed: dict[str, int] = {}  # leading blocks already named in the cache
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.fresh)

    @property
    def num_written_blocks(self) -> int:
        """Blocks written at least once: on the CPU, the KV cache's resident share."""
        return self.num_blocks - len(self.fresh)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks that start this request's tokens, and how many tokens they hold.

        The last token is never served from the cache: it must be computed to get logits.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Give `request` room for `num_new_tokens` more tokens after its computed ones.

        Returns the ids of the newly allocated blocks, or None (and changes nothing) when there
        are not enough free blocks.
        """
        computed = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(computed)
        # Cached hits that are currently free leave the free queue when this request takes them.
        free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_needed > self.num_free_blocks - free_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        for block in computed:
            self._touch(block)
        blocks.extend(computed)
        if computed:
            self.req_num_hashed[request.request_id] = len(blocks)
        new_blocks = [self._pop_free() for _ in range(max(num_needed, 0))]
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_num_hashed.pop(request.request_id, None)
        # Tail blocks first, so that they are evicted before the shared prefix.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False  # blocks in use
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def _touch(self, block: KVCacheBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> KVCacheBlock:
        if self.fresh and not (self.reuse_written_first and self.free_queue):
            block = self.blocks[self.fresh.popleft()]
            block.ref_cnt = 1
            return block
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], tokens: int) -> None:
        """Name the blocks that `tokens` tokens fill, so later requests can find them."""
        num_full = min(tokens, request.num_tokens) // self.block_size  # only known tokens
        start = self.req_num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            block = blocks[i]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block
        self.req_num_hashed[request.request_id] = num_full

    def _block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * size <= len(tokens):
            parent = hashes[-1] if hashes else _ROOT_HASH
            i = len(hashes)
            hashes.append(hash((parent, tuple(tokens[i * size : (i + 1) * size]))))
        return hashes
