"""A GGUF file's tokenizer, written without transformers (issue 15, cold start), is the one
transformers' own GGUF conversion gives: the same ids, text, chat template and special tokens, on
the bundled model and on small SentencePiece and byte-level files; tokenizer models not built
natively still convert, with transformers."""

from __future__ import annotations

import json

import pytest
from gguf_files import (
    assert_same_config,
    byte_level_metadata,
    converted,
    llama_shape_keys,
    sentencepiece_metadata,
    transformers_config,
    transformers_tokenizer,
    write_gguf,
)

from llmctl.engine.model_loader.default_model import default_model_path
from llmctl.engine.model_loader.gguf import ensure_converted
from llmctl.engine.tokenizer.light_tokenizer import LightTokenizer
from llmctl.engine.tokenizer.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def bundled():
    return default_model_path()


@pytest.fixture(scope="module")
def their_tokenizer(bundled):
    """transformers' conversion of the bundled GGUF's tokenizer (~10 s)."""
    return transformers_tokenizer(bundled)


TEXTS = [
    "Hello world!",
    "",
    " ",
    "   leading, trailing and  double  spaces   ",
    "tabs\tand\nnewlines\r\n\n\n  indented",
    "héllo ünïcode: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 😀👍🏽 🇫🇷 ZWJ 👩‍👩‍👧 and ☃",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-11-24",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special tokens in text",
    "<s> </s> <unk> <think>not special here</think>",
    "Don't stop , ok ? I 'm sure . It's they're we've I'd",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "a" * 300,
]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2? {{ not a template }} 😀"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


def assert_same_tokenizer(ours, theirs, texts=TEXTS, conversations=()) -> None:
    for text in texts:
        for add in (True, False):
            ids = theirs.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id"), name
    assert ours.get_vocab() == theirs.get_vocab()
    for conversation in conversations:
        for add_generation_prompt in (True, False):
            kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(conversation, **kw) == theirs.apply_chat_template(
                conversation, **kw
            )


def test_bundled_tokenizer_matches_transformers_gguf_conversion(smol_dir, their_tokenizer):
    from transformers import AutoTokenizer

    ours = get_tokenizer(str(smol_dir))
    assert isinstance(ours, LightTokenizer)
    theirs = their_tokenizer
    assert_same_tokenizer(ours, theirs, conversations=CONVERSATIONS)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>
    # transformers reading the written directory sees the same tokenizer
    assert_same_tokenizer(
        AutoTokenizer.from_pretrained(smol_dir), theirs, conversations=CONVERSATIONS
    )


def test_llama_sentencepiece_gguf_matches_transformers(tmp_path, monkeypatch):
    gguf = write_gguf(
        tmp_path / "spm.gguf",
        "llama",
        {**llama_shape_keys(), **sentencepiece_metadata()},
        ("token_embd.weight", "output.weight"),
    )
    directory = converted(gguf, monkeypatch, tmp_path / "cache")
    ours = get_tokenizer(str(directory))
    assert isinstance(ours, LightTokenizer)
    theirs = transformers_tokenizer(gguf)
    assert_same_tokenizer(ours, theirs, conversations=CONVERSATIONS)
    assert ours.encode("hello")[0] == 1  # BOS, as llama.cpp adds it
    assert_same_config(directory, transformers_config(gguf))
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm"])
def test_qwen2_byte_level_gguf_matches_transformers(tmp_path, monkeypatch, pre):
    """Qwen2's own split regex (digits one by one), Llama 3's (up to three), GPT-2's."""
    metadata = {**llama_shape_keys(hidden=64, heads=4, kv_heads=4), **byte_level_metadata(pre)}
    gguf = write_gguf(tmp_path / "qwen2.gguf", "qwen2", metadata, ("token_embd.weight",))
    directory = converted(gguf, monkeypatch, tmp_path / "cache")
    ours = get_tokenizer(str(directory))
    assert isinstance(ours, LightTokenizer)
    assert_same_tokenizer(ours, transformers_tokenizer(gguf), conversations=CONVERSATIONS)
    assert_same_config(directory, transformers_config(gguf))


def test_tokenizer_models_not_built_natively_go_to_transformers(tmp_path, monkeypatch, caplog):
    """A tokenizer model this does not build (here a unigram "t5" vocabulary) is converted by
    transformers, with a line in the log saying so."""
    import logging

    metadata = {**llama_shape_keys(), **sentencepiece_metadata(), "tokenizer.ggml.model": "t5"}
    gguf = write_gguf(tmp_path / "t5tok.gguf", "llama", metadata, ("token_embd.weight",))
    with caplog.at_level(logging.INFO, logger="llmctl"):
        directory = converted(gguf, monkeypatch, tmp_path / "cache")
    assert any("converting its tokenizer with transformers" in r.message for r in caplog.records)
    assert (directory / "tokenizer.json").is_file()
    theirs = transformers_tokenizer(gguf)
    ours = get_tokenizer(str(directory))
    for text in TEXTS[:6]:
        assert ours.encode(text) == theirs.encode(text)


def test_a_vocabulary_tokenizers_refuses_goes_to_transformers(tmp_path, monkeypatch, caplog):
    """Merges naming a token the vocabulary lacks: the tokenizers library refuses them, and the
    conversion goes on with transformers' converter (which refuses them too, with a warning);
    the config is written either way."""
    import logging

    metadata = {**llama_shape_keys(), **byte_level_metadata("qwen2", size=300)}
    metadata["tokenizer.ggml.merges"] = [*metadata["tokenizer.ggml.merges"], "Ġ zzzz"]
    gguf = write_gguf(tmp_path / "bad-merges.gguf", "qwen2", metadata, ("token_embd.weight",))
    with caplog.at_level(logging.INFO, logger="llmctl"):
        directory = converted(gguf, monkeypatch, tmp_path / "cache")
    assert "a vocabulary the tokenizers library refused" in caplog.text
    assert (directory / "config.json").is_file()


def test_a_file_without_vocabulary_converts_its_config(tmp_path, monkeypatch, caplog):
    gguf = write_gguf(tmp_path / "bare.gguf", "llama", llama_shape_keys(), ("token_embd.weight",))
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(Exception) as failed:  # no vocab_size and no vocabulary: no shape
        ensure_converted(gguf)
    assert "vocab_size" in str(failed.value)
    metadata = {**llama_shape_keys(), "{arch}.vocab_size": 300}
    gguf = write_gguf(tmp_path / "novocab.gguf", "llama", metadata, ("token_embd.weight",))
    directory = ensure_converted(gguf)
    assert (directory / "config.json").is_file()
    assert not (directory / "tokenizer.json").exists()
    assert "holds no tokenizer" in caplog.text
