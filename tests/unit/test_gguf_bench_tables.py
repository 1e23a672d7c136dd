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


def test_the_best_peer_ratio_is_the_interleaved_one(capsys):
    """llmctl in turns with each peer: its ratio to the best peer (and the goal's) is that pair's
    median ratio, not llmctl's median over all its rounds against the peer's median."""
    bench = load_script()
    pair_llamacpp = row(120.0, rates=[118.0, 120.0, 121.0], ratio_to={"llamacpp": 1.31})
    pair_bf16 = row(100.0, rates=[99.0, 100.0, 102.0], ratio_to={"transformers-bf16": 4.1})
    llmctl = bench.merge_llmctl_rows([pair_llamacpp, pair_bf16], ["W1"])
    assert llmctl["W1"]["tok_s"] == 110.0  # the median of all six rounds
    assert llmctl["W1"]["ratio_to"] == {"llamacpp": 1.31, "transformers-bf16": 4.1}
    rows = {
        ("llmctl", "2"): llmctl,
        ("llamacpp", "2"): row(90.0),
        ("transformers-bf16", "2"): row(25.0),
    }
    bench.print_best_peer(rows, "llmctl", ["llamacpp", "transformers-bf16"], ["W1"])
    out = capsys.readouterr().out
    assert "W1 1.31x llamacpp (1.31x llamacpp, goal 1.2x)" in out, out  # not 110 / 90 = 1.22x
