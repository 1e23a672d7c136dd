"""The attention metadata of the step being run, visible to every Attention layer.

The model runner builds it once per step (block tables, slot mapping, masks) and sets it around
the forward pass, so model code passes only hidden states between layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_ATTN_METADATA: Any = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _ATTN_METADATA
    previous, _ATTN_METADATA = _ATTN_METADATA, attn_metadata
    try:
        yield
    finally:
        _ATTN_METADATA = previous


def get_attn_metadata() -> Any:
    if _ATTN_METADATA is None:
        raise RuntimeError("Attention ran outside set_forward_context(): no metadata for this step")
    return _ATTN_METADATA
