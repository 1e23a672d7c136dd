"""dtype="auto" picks what is fast on the device; the CPU path follows the CPU's flags."""

from __future__ import annotations

import logging

import pytest

from llmctl.engine import platform
from llmctl.engine.errors import ConfigError

AMX = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
ZEN4 = {"avx2", "fma", "avx512f", "avx512_bf16"}
AVX2 = {"avx2", "fma"}


@pytest.mark.parametrize(
    "flags, expected",
    [
        (ZEN4, "bfloat16"),
        ({"avx2", "fma", "amx_bf16", "amx_tile"}, "bfloat16"),
        ({"avx2", "fma", "avx512f"}, "float32"),  # AVX-512 without BF16: emulated, slow
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


@pytest.mark.parametrize(
    "flags, name, dtype",
    [
        (AMX, "amx", "bfloat16"),
        (ZEN4, "avx512_bf16", "bfloat16"),
        (AVX2 | {"avx512f"}, "avx2", "float32"),
        (AVX2, "avx2", "float32"),
        ({"sse4_2"}, "baseline", "float32"),
    ],
)
def test_the_cpu_path_follows_the_flags(flags, name, dtype):
    path = platform.cpu_path(flags)
    assert (path.name, path.activation_dtype, path.bf16_tiles) == (name, dtype, dtype != "float32")
    assert path.describe().startswith(f"CPU path {name}: {dtype} activations")
    decode = "AVX512-BF16 dot products" if name == "avx512_bf16" else "loops"
    assert f"int4 decode in {path.int4_decode}" in path.describe() and decode in path.int4_decode


def test_prefill_runs_int8_activations_where_vnni_meets_avx512_bf16(monkeypatch):
    vnni = ZEN4 | {"avx512_vnni", "avx512bw"}
    assert platform.cpu_path(vnni).int8_prefill
    assert "prefill batches of quantized weights on int8 activations" in (
        platform.cpu_path(vnni).describe()
    )
    assert not platform.cpu_path(vnni - {"avx512_vnni"}).int8_prefill
    assert not platform.cpu_path(AMX | {"avx512_vnni", "avx512bw"}).int8_prefill  # AMX tiles
    monkeypatch.setenv("LLMCTL_CPU_INT8_PREFILL", "0")
    path = platform.cpu_path(vnni)
    assert (path.name, path.int8_prefill) == ("avx512_bf16", False)
    assert "int8" not in path.describe()


def test_avx2_batches_run_int8_activations_unless_turned_off(monkeypatch):
    path = platform.cpu_path(AVX2)
    assert (path.name, path.activation_dtype, path.int8_prefill) == ("avx2", "float32", True)
    assert "batches of 64 rows or more of 4-bit weights on int8 activations" in path.describe()
    monkeypatch.setattr(platform, "cpu_flags", lambda: AVX2)
    assert platform.int8_activations("auto", "cpu")
    # dtype="float32" by name: the float path's numerics; the GPU: never
    assert not platform.int8_activations("float32", "cpu")
    assert not platform.int8_activations("auto", "cuda")
    monkeypatch.setattr(platform, "cpu_flags", lambda: ZEN4)  # bfloat16 activations there
    assert not platform.int8_activations("auto", "cpu")
    monkeypatch.setattr(platform, "cpu_flags", lambda: AVX2)
    monkeypatch.setenv("LLMCTL_CPU_INT8_PREFILL", "0")
    assert not platform.int8_activations("auto", "cpu")
    path = platform.cpu_path(AVX2)
    assert (path.name, path.int8_prefill) == ("avx2", False)
    assert "int8" not in path.describe()


def test_flags_named_off_are_absent(monkeypatch, tmp_path):
    real = platform.cpu_flags()
    monkeypatch.setenv("LLMCTL_CPU_FLAGS_OFF", "amx*, avx512*")
    masked = platform.cpu_flags()
    assert not any(f.startswith(("amx", "avx512")) for f in masked)
    assert masked == {f for f in real if not f.startswith(("amx", "avx512"))}
    assert platform.cpu_path().name in ("avx2", "baseline")
    assert platform.resolve_dtype("auto", "cpu", "bfloat16") == "float32"


def test_the_cpu_path_is_logged_once(caplog):
    platform.log_cpu_path.cache_clear()
    with caplog.at_level(logging.INFO, logger="llmctl"):
        first = platform.log_cpu_path()
        assert platform.log_cpu_path() is first
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU path")]
    assert lines == [first.describe()]
