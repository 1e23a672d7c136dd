"""benchmarks/gguf_vs_llamacpp.py's tables: with --interleave, llmctl's ratio to llama.cpp is the
median of the alternating rounds' ratios, and its ratios to the other peers (run once each) are
their own tok/s ratios; the interleaved one was once printed for every peer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_vs_llamacpp.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gguf_vs_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(tok_s: float, **extra) -> dict:
    return {"start_s": 1.0, "W1": {"tok_s": tok_s, "first_ids": [1, 2], **extra}}


def test_each_peer_gets_its_own_ratio(capsys):
    bench = load_script()
    rows = {
        ("llmctl", "2"): row(134.0, ratio_to={"llamacpp": 1.24}),
        ("llamacpp", "2"): row(110.0),
        ("transformers", "2"): row(29.9),
    }
    pairs = [("llmctl", "llamacpp"), ("llmctl", "transformers")]
    bench.print_table("GGUF", rows, pairs, ["W1"])
    out = capsys.readouterr().out
    assert "llmctl / llamacpp, threads 2: W1 1.24x" in out  # the rounds' median, not 134 / 110
    assert "llmctl / transformers, threads 2: W1 4.48x" in out  # 134 / 29.9
