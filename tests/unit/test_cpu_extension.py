"""Which compiler flags and build name a CPU kernel gets (engine/kernels/cpu/cpu_extension.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine.kernels.cpu.cpu_extension import build_spec

SOURCE = Path(__file__).resolve().parents[2] / "engine" / "kernels" / "cpu" / "fused_decode_cpu.cpp"


def test_native_unless_another_target_is_named(monkeypatch):
    monkeypatch.delenv("LLMCTL_CPU_MARCH", raising=False)
    native, cflags, _ = build_spec(SOURCE, "k", "native", ())
    assert "-march=native" in cflags

    monkeypatch.setenv("LLMCTL_CPU_MARCH", "znver3")
    older, cflags, _ = build_spec(SOURCE, "k", "native", ())
    assert "-march=znver3" in cflags and "-march=native" not in cflags
    assert older != native  # its own build, side by side with the native one

    # An explicit target (the tests' other instruction-set builds) is not overridden.
    assert "-march=x86-64" in build_spec(SOURCE, "k", "x86-64", ())[1]


@pytest.mark.parametrize("value", ["znver3 -fplugin=evil.so", "native;rm", "a b"])
def test_a_value_that_is_not_one_target_is_refused(monkeypatch, value):
    monkeypatch.setenv("LLMCTL_CPU_MARCH", value)
    with pytest.raises(ValueError, match="LLMCTL_CPU_MARCH=.* is not a -march value"):
        build_spec(SOURCE, "k", "native", ())


def test_hidden_cpu_flags_share_the_native_build(monkeypatch):
    """LLMCTL_CPU_FLAGS_OFF picks the Python side's paths; the compiler still emits code for
    -march, so the build (and its name) stays the native one: no rebuild per emulated path."""
    monkeypatch.delenv("LLMCTL_CPU_MARCH", raising=False)
    monkeypatch.delenv("LLMCTL_CPU_FLAGS_OFF", raising=False)
    native = build_spec(SOURCE, "k", "native", ())
    monkeypatch.setenv("LLMCTL_CPU_FLAGS_OFF", "avx512*,amx*")
    assert build_spec(SOURCE, "k", "native", ()) == native
