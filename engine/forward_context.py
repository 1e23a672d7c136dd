"""The attention metadata of the step being run, visible to every Attention layer.

The model runner builds it once per step (block tables, slot mapping, masks) and sets it around
the forward pass, so model code passes only hidden states between layers. With expert
parallelism across data-parallel replicas, the step's token count on every replica is part of
it too: gathered by the first MoE layer, reused by the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_ATTN_METADATA: Any = None
_DP_NUM_TOKENS: list[int] | None = None
_PASS_MEMO: dict | None = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _ATTN_METADATA, _DP_NUM_TOKENS, _PASS_MEMO
    previous = _ATTN_METADATA, _DP_NUM_TOKENS, _PASS_MEMO
    _ATTN_METADATA, _DP_NUM_TOKENS, _PASS_MEMO = attn_metadata, None, {}
    try:
        yield
    finally:
        _ATTN_METADATA, _DP_NUM_TOKENS, _PASS_MEMO = previous


def pass_memo() -> dict:
    """Values computed once per forward pass and shared by its layers (the rotary cos/sin rows
    of the step's positions). A new dict each time set_forward_context() is entered, so nothing
    outlives its pass: a CUDA graph captured in its own context records the computation
    instead of reading a tensor an earlier eager pass made (and later freed). Outside a context,
    a throwaway dict: nothing is shared."""
    return _PASS_MEMO if _PASS_MEMO is not None else {}


def get_attn_metadata() -> Any:
    if _ATTN_METADATA is None:
        raise RuntimeError("Attention ran outside set_forward_context(): no metadata for this step")
    return _ATTN_METADATA


def num_tokens_across_dp(num_tokens: int, dp_group, device: Any = None) -> list[int]:
    """This step's token count on each rank of `dp_group` (a GroupCoordinator), in its rank
    order: one all-gather (of a tensor on `device`) per forward pass (every rank's MoE layers
    call it alike)."""
    global _DP_NUM_TOKENS
    if _DP_NUM_TOKENS is not None and _ATTN_METADATA is not None:
        return _DP_NUM_TOKENS
    import torch

    mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    counts = dp_group.all_gather(mine).tolist()
    if _ATTN_METADATA is not None:
        _DP_NUM_TOKENS = counts
    return counts
