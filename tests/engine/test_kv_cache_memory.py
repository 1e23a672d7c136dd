"""The CPU KV cache is zero-filled but costs no resident memory until its blocks are written."""

import os

import torch

from llmctl.engine.worker.model_runner import zeroed_kv_cache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_kv_cache_is_zero_and_not_resident_until_written():
    shape = (2, 4096, 16, 4, 64)  # 128 MiB of float32
    before = _rss_bytes()
    cache = zeroed_kv_cache(shape, torch.float32, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert _rss_bytes() - before < 16 << 20  # nothing touched yet
    cache[1, 7] = 3.0
    assert cache[1, 7].eq(3.0).all() and cache[0].eq(0).all()  # reading maps zero pages
    assert float(cache.sum()) == 3.0 * 16 * 4 * 64


def test_empty_and_bfloat16_caches():
    assert zeroed_kv_cache((2, 0, 16, 1, 8), torch.float32, torch.device("cpu")).numel() == 0
    cache = zeroed_kv_cache((2, 3, 16, 1, 8), torch.bfloat16, torch.device("cpu"))
    assert cache.dtype == torch.bfloat16 and cache.eq(0).all()
