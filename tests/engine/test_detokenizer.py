"""Incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

from llmctl.engine.core.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import SamplingParams

TEXT = "Café au lait ☕ costs 3€; 東京は晴れ 🌤️ today.\n  Indented line."


def feed(tokenizer, ids, params, prompt=(1, 2)):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params)
    seen = []
    for i, token in enumerate(ids):
        stop = detok.update([token], finished=i == len(ids) - 1)
        seen.append(detok.get_text(i == len(ids) - 1))
        if stop:
            return detok, seen, stop
    return detok, seen, None


def test_incremental_text_equals_one_decode(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)
    detok, seen, _ = feed(smol_tokenizer, ids, SamplingParams())
    assert detok.output_text == smol_tokenizer.decode(ids) == TEXT
    # Every intermediate text is a prefix of the final one: no broken characters shown.
    assert all(TEXT.startswith(text) and "\ufffd" not in text for text in seen)


def test_stop_string_cuts_the_text(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)
    detok, _, stop = feed(smol_tokenizer, ids, SamplingParams(stop=["晴れ", "nothing"]))
    assert stop == "晴れ"
    assert detok.output_text == TEXT[: TEXT.index("晴れ")]


def test_streamed_text_holds_back_a_possible_stop_string(smol_tokenizer):
    ids = smol_tokenizer.encode("abc STOP def")
    detok = IncrementalDetokenizer(smol_tokenizer, [1], SamplingParams(stop=["STOP"]))
    shown = []
    for token in ids:
        if detok.update([token], finished=False):
            break
        shown.append(detok.get_text(finished=False))
    assert all("STO" not in s for s in shown)  # never shows part of the stop string
    assert detok.get_text(finished=True) == "abc "


def test_min_tokens_delays_stop_strings(smol_tokenizer):
    ids = smol_tokenizer.encode("stop here, stop there")
    detok, _, stop = feed(
        smol_tokenizer, ids, SamplingParams(stop=["stop"], min_tokens=3, max_tokens=20)
    )
    assert stop == "stop"
    assert detok.output_text == "stop here, "
