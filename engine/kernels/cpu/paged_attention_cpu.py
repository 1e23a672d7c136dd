"""Paged decode attention on the CPU: a fused C++ kernel, with gather + SDPA as the fallback.

    paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window,
                           sinks)

q: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks, block_size,
num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks_per_seq] int64 (rows padded with
any valid block id); seq_lens: [num_seqs] int64, the tokens visible to each sequence's query,
itself included. Query head h reads KV head h // (num_heads // num_kv_heads). With a sliding
window the query (position seq_len - 1) sees keys at positions > seq_len - 1 - window. With
sinks ([num_heads] float32, gpt-oss) head h's softmax has one more term, exp(sinks[h]), in its
denominator and none in the output: probabilities over the keys sum to less than one.

The kernel (paged_attention_cpu.cpp) reads each K and V row once, for all the query heads that
share it, straight from the paged cache; gather + scaled_dot_product_attention first copies
every sequence's blocks. It is compiled with -march=native once: at set-up (`make setup` runs
`python -m llmctl.engine.kernels.cpu.cpu_kernels`), else on first use (10-20 s, with
a spinner on a terminal), into $LLMCTL_CACHE_DIR/torch_extensions, else $TORCH_EXTENSIONS_DIR,
else torch's default extensions directory, under a name that hashes the source, the flags, torch,
Python and the CPU's features, so a cache directory shared by different machines never serves a
binary built for another CPU.
If it cannot be built, paged_decode_attention_sdpa does the work and one warning says why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from llmctl.engine.kernels.cpu.cpu_extension import (
    build_root as _build_root,
)
from llmctl.engine.kernels.cpu.cpu_extension import (
    build_spec,
    compile_extension,
    first_error_line,
)

logger = logging.getLogger("llmctl")

# One extension: the decode kernel, the prefill one (prefill_attention.py) and the cache write
_SOURCE = (
    Path(__file__).with_suffix(".cpp"),
    Path(__file__).with_name("prefill_attention_cpu.cpp"),
    Path(__file__).with_name("kv_cache_write_cpu.cpp"),
    Path(__file__).with_name("exp_nonpositive.h"),
    Path(__file__).with_name("transpose16.h"),
)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_MAX_HEAD_DIM = 256  # kMaxHeadDim in the kernel
_PREFIX = "llmctl_paged_attention"


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache; see the module doc."""
    if q.device.type == "cpu" and q.dtype in _KERNEL_DTYPES and q.shape[-1] <= _MAX_HEAD_DIM:
        op = _kernel()
        if op is not None:
            return op(
                q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, sinks
            )
    return paged_decode_attention_sdpa(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, sinks
    )


def write_kv_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """k, v ([num_tokens, num_kv_heads, head_dim]) into their slots of the paged caches
    ([num_blocks, block_size, num_kv_heads, head_dim]; a negative slot is padding) by the C++
    copy (kv_cache_write_cpu.cpp). False, writing nothing, where it is not built or cannot take
    the caches: the caller writes them itself."""
    name = namespace() if key_cache.device.type == "cpu" else None
    if name is None or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return False
    getattr(torch.ops, name).write_kv_cache(key_cache, value_cache, k, v, slot_mapping)
    return True


def kernel_available() -> bool:
    """True when the C++ kernel is built and loaded (building it now if needed)."""
    return _kernel() is not None


def paged_decode_attention_sdpa(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fallback: gather each sequence's blocks with index_select, then one batched SDPA."""
    block_ids, bias = decode_sdpa_metadata(
        block_tables, seq_lens, key_cache.shape[1], sliding_window, q.dtype
    )
    return gathered_sdpa(q, key_cache, value_cache, block_ids, bias, scale, sinks)


def decode_sdpa_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat block ids [num_seqs * max_blocks] and additive mask [num_seqs, 1, 1, max_len]."""
    num_seqs, max_blocks = block_tables.shape
    key_pos = torch.arange(max_blocks * block_size, device=seq_lens.device).unsqueeze(0)
    lens = seq_lens.unsqueeze(1)
    visible = key_pos < lens
    if sliding_window is not None:
        visible &= key_pos >= lens - sliding_window
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    bias.masked_fill_(~visible, float("-inf"))
    return block_tables.reshape(-1), bias.view(num_seqs, 1, 1, -1)


def gathered_sdpa(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch decode of one layer, given decode_sdpa_metadata's tensors. Sinks join as a
    zero key and value whose score (through the additive mask) is the head's sink."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    shape = (num_seqs, -1, num_kv_heads, head_dim)
    keys = key_cache.index_select(0, block_ids).view(shape).transpose(1, 2)
    values = value_cache.index_select(0, block_ids).view(shape).transpose(1, 2)
    # [num_seqs, num_kv_heads, group, head_dim]: a KV head's query heads as its query rows
    grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    if sinks is not None:
        zero = keys.new_zeros(num_seqs, num_kv_heads, 1, head_dim)
        keys, values = torch.cat([keys, zero], dim=2), torch.cat([values, zero], dim=2)
        sink = sinks.to(bias.dtype).view(1, num_kv_heads, group, 1)
        sink = sink.expand(num_seqs, num_kv_heads, group, 1)
        bias = torch.cat([bias.expand(num_seqs, num_kv_heads, group, -1), sink], dim=-1)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


# -- building the kernel -----------------------------------------------------------------------


@functools.cache
def _kernel() -> Callable[..., torch.Tensor] | None:
    name = namespace()
    return None if name is None else getattr(torch.ops, name).paged_decode_attention


@functools.cache
def namespace() -> str | None:
    """The built extension's op namespace (decode, prefill, the cache write), None when it
    cannot be built (one warning says why)."""
    try:
        return build_namespace()
    except Exception as e:  # a missing compiler, ninja or header: degrade, don't fail the engine
        logger.warning(
            "CPU paged attention kernel unavailable, decoding with gather + "
            "scaled_dot_product_attention instead: %s",
            first_error_line(e),
        )
        logger.debug("building the CPU paged attention kernel failed", exc_info=True)
        return None


def build_kernel(march: str = "native", extra_cflags: tuple[str, ...] = ()) -> Callable:
    """Compile (or reuse) the kernel for -march=`march` and return its torch op.

    Each flag set gets its own extension name and op namespace, so several builds can be
    loaded in one process (the tests load a portable build next to the native one).
    """
    return getattr(torch.ops, build_namespace(march, extra_cflags)).paged_decode_attention


def build_namespace(march: str = "native", extra_cflags: tuple[str, ...] = ()) -> str:
    """Compile (or reuse) the extension for -march=`march`; its op namespace's name."""
    return compile_extension(_SOURCE, _PREFIX, "CPU paged attention kernel", march, extra_cflags)


def _build_spec(march: str, extra_cflags: tuple[str, ...]) -> tuple[str, list[str], list[str]]:
    return build_spec(_SOURCE, _PREFIX, march, extra_cflags)


def main(argv: list[str] | None = None) -> int:
    """`python -m llmctl.engine.kernels.cpu.paged_attention_cpu --build`: compile this kernel now
    (`make setup` builds all of them: llmctl.engine.kernels.cpu.cpu_kernels) and say where."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile (or find) the kernel")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_kernel()
    print(f"CPU paged attention kernel ready in {_build_root()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
