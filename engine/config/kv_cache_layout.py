"""KVCacheLayout: how a model's attention layers share the paged KV cache (vLLM's hybrid
allocator). Pure: no torch.

Layers are grouped by the keys their queries can see: full attention, or a sliding window of W
tokens. A model whose layers are all alike has one group, holding every layer, and the cache is
what it always was: a block id names the same slots in every layer. A model that mixes the two
(Gemma 3: five sliding layers to one global; gpt-oss: alternating) gets one group per run of
`group_size` layers of one kind, and every group gets its own block table per request. The
cache is then `group_size` tensors of [2, num_blocks, block_size, num_kv_heads, head_dim] per
pipeline stage, the j-th shared by the j-th layer of every group: a block id belongs to one
group at a time (the block manager hands it out), so the layers that share a tensor never
write the same block. A sliding group's blocks that fall wholly out of every future query's
window go back to the pool (engine/core/block_manager.py), so a long request holds about W
tokens of its sliding layers instead of all of them: that is the capacity gain.

    gpt-oss (24 layers, W=128): groups full(1,3,...,23) and sliding(0,2,...,22), 12 tensors;
    a 131,072-token request holds 8,192 + 521 blocks of 12 layers instead of 8,192 of 24.

A window at least max_model_len never bites: such a layer counts as full attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # global decoder layer indices, ascending
    sliding_window: int | None  # None: full attention


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    block_size: int

    @classmethod
    def for_layers(
        cls, windows: Sequence[int | None], max_model_len: int, block_size: int
    ) -> KVCacheLayout:
        """The layout of layers whose sliding windows are `windows` (None: full attention)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            if window is not None and window >= max_model_len:
                window = None
            kinds.setdefault(window, []).append(layer)
        if len(kinds) <= 1:
            window = next(iter(kinds), None)
            return cls((KVCacheGroup(tuple(range(len(windows))), window),), block_size)
        counts = [len(layers) for layers in kinds.values()]
        # vLLM's choice: groups of the rarest kind's size, or of the commonest's when the kinds
        # are nearly even (fewer groups, little padding).
        size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
        groups = [
            KVCacheGroup(tuple(layers[i : i + size]), window)
            for window, layers in kinds.items()
            for i in range(0, len(layers), size)
        ]
        groups.sort(key=lambda g: g.layers[0])
        return cls(tuple(groups), block_size)

    @classmethod
    def for_shape(cls, shape, max_model_len: int, block_size: int) -> KVCacheLayout:
        """`shape`: a ModelShape."""
        windows = [shape.layer_sliding_window(i) for i in range(shape.num_layers)]
        return cls.for_layers(windows, max_model_len, block_size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def describe(self) -> str:
        """ "12 layers window 128, 12 layers full": each group, in order."""
        return ", ".join(
            f"{len(g.layers)} layers "
            + ("full" if g.sliding_window is None else f"window {g.sliding_window}")
            for g in self.groups
        )

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each group's window, in group order (what the block manager frees blocks by)."""
        return tuple(g.sliding_window for g in self.groups)

    def placement(self, start: int, end: int) -> dict[int, tuple[int, int]]:
        """Layer -> (its group, the shared tensor it uses) for the layers [start, end) of one
        pipeline stage: a group's layers on the stage take tensors 0, 1, ... in order."""
        out = {}
        for g, group in enumerate(self.groups):
            mine = [layer for layer in group.layers if start <= layer < end]
            for tensor, layer in enumerate(mine):
                out[layer] = (g, tensor)
        return out

    def num_tensors(self, start: int, end: int) -> int:
        """Shared KV tensors on the stage of layers [start, end): its largest group's layers.
        A block of the cache is one slot range in each of them."""
        return max(
            (sum(start <= layer < end for layer in g.layers) for g in self.groups), default=0
        )

    def request_tokens(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """The KV slots, summed over the groups, that one request of `num_tokens` tokens holds at
        most: a full group every token; a sliding group its window and the step's new tokens,
        in whole blocks, with one block of slack for a window that straddles block edges."""
        bs = self.block_size
        total = 0
        for group in self.groups:
            window = group.sliding_window
            if window is None:
                total += num_tokens
            else:
                held = (-(-(window - 1 + max_num_batched_tokens) // bs) + 1) * bs
                total += min(num_tokens, held)
        return total

    def request_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at most (as request_tokens)."""
        bs = self.block_size
        total = 0
        for group in self.groups:
            window = group.sliding_window
            blocks = -(-num_tokens // bs)
            if window is not None:
                blocks = min(blocks, -(-(window - 1 + max_num_batched_tokens) // bs) + 1)
            total += blocks
        return total

    def cache_tokens(self, num_blocks: int) -> int:
        """vLLM's "KV cache size" in tokens: the blocks shared evenly by the groups."""
        return num_blocks // self.num_groups * self.block_size

    def max_concurrency(
        self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int
    ) -> float:
        """How many requests of max_model_len tokens the cache holds at once."""
        held = self.request_tokens(max_model_len, max_num_batched_tokens)
        return num_blocks * self.block_size / held
