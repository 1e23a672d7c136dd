"""dtype="auto" picks what is fast on the device."""

from __future__ import annotations

import pytest

from llmctl.engine import platform
from llmctl.engine.errors import ConfigError


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
        ({"avx2", "avx512f"}, "float32"),  # AVX-512 without BF16: emulated, slow
        (set(), "float32"),
    ],
)
def test_auto_on_cpu(monkeypatch, flags, expected):
    monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
    assert platform.resolve_dtype("auto", "cpu", "float32") == expected


def test_auto_on_cuda_follows_the_checkpoint():
    assert platform.resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert platform.resolve_dtype("auto", "cuda", "float32") == "float16"
    assert platform.resolve_dtype("auto", "cuda", None) == "float16"


def test_explicit_dtypes():
    assert platform.resolve_dtype("float32", "cpu", "bfloat16") == "float32"
    with pytest.raises(ConfigError) as err:
        platform.resolve_dtype("float16", "cpu", None)
    assert "--dtype float32" in err.value.hint


def test_auto_keeps_quantized_weights_float32_on_a_bfloat16_cpu(monkeypatch):
    # The quantized matmul and fused decode kernels take float32 activations: in bfloat16 the
    # bundled Q4_1 model decoded 2.1x slower on an AVX512-BF16 machine.
    monkeypatch.setattr(platform, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert platform.resolve_dtype("auto", "cpu", "bfloat16", quantized=True) == "float32"
    assert platform.resolve_dtype("auto", "cpu", "bfloat16") == "bfloat16"
    assert platform.resolve_dtype("bfloat16", "cpu", None, quantized=True) == "bfloat16"
    assert platform.resolve_dtype("auto", "cuda", "bfloat16", quantized=True) == "bfloat16"
