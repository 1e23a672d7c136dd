"""GGUFTokenizer: a GGUF file's tokenizer, written as tokenizer.json + tokenizer_config.json with
the `tokenizers` library alone.

A GGUF file holds its tokenizer as metadata: the vocabulary (`tokenizer.ggml.tokens`), the token
types, the merges or the SentencePiece scores, the special token ids and the chat template.
transformers converts them (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) in ~10 s on the
bundled model, after ~3 s importing itself; this builds the same tokenizer in well under a second,
the way transformers' GGUF converter does (transformers/integrations/gguf/
gguf_tokenizer_mapping.py): the same vocabulary, merges, pre-tokenizer, decoder, added tokens and
BOS/EOS post-processor, so that LightTokenizer and AutoTokenizer give the same ids either way
(tests/engine/test_gguf_tokenizer.py compares them with transformers' conversion).

Covered `tokenizer.ggml.model`s: "gpt2" (byte-level BPE with merges: SmolLM2, Qwen2, Llama 3) and
"llama" (SentencePiece BPE with byte fallback, merges recovered from the scores when the file has
none: Llama 2, Mistral, TinyLlama). `unsupported()` names what is not covered; gguf.py then falls
back to transformers' converter.

Where transformers would give a token id past the model's vocabulary (a tokenizer class's default
special token, such as GPT-2's "<|endoftext|>", that the vocabulary lacks, appended as a new
token), this leaves the token out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

# The metadata arrays the tokenizer needs whole (gguf_file.read_gguf_metadata(arrays=...)).
TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# The special tokens each transformers tokenizer class adds itself (GPT2Tokenizer, LlamaTokenizer).
_CLASS_DEFAULT_TOKENS = {"gpt2": ("<|endoftext|>",), "llama": ("<unk>", "<s>", "</s>")}
_VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when none is known

# `tokenizer.ggml.pre` -> the regex the vocabulary's merges were learned with (llama.cpp's
# pre-tokenizers, as transformers' GGUF converter lists them); others split as GPT-2 does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@dataclass(frozen=True)
class GGUFTokenizer:
    model: str | None  # tokenizer.ggml.model: "gpt2", "llama", ...
    pre: str | None  # tokenizer.ggml.pre: which split regex
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special_tokens: dict[str, str | None]  # bos_token/eos_token/unk_token/pad_token -> text
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> GGUFTokenizer | None:
        """From metadata read with TOKENIZER_ARRAYS whole; None when the file has no vocabulary."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            return None
        model = metadata.get("tokenizer.ggml.model")
        special = {}
        for name, key in _SPECIAL_IDS.items():
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            valid = isinstance(token_id, int) and 0 <= token_id < len(tokens)
            special[name] = tokens[token_id] if valid else None
        types = metadata.get("tokenizer.ggml.token_type")
        scores = metadata.get("tokenizer.ggml.scores")
        merges = metadata.get("tokenizer.ggml.merges")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", model == "llama")
        template = metadata.get("tokenizer.chat_template")
        return cls(
            model=model,
            pre=metadata.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=types if isinstance(types, list) else [],
            scores=scores if isinstance(scores, list) else None,
            merges=merges if isinstance(merges, list) else None,
            special_tokens=special,
            add_bos_token=bool(add_bos),
            add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    def unsupported(self) -> str | None:
        """Why this tokenizer cannot be built here (None: it can)."""
        if self.model not in _CLASS_DEFAULT_TOKENS:
            return f"tokenizer model {self.model!r} (covered: {', '.join(_CLASS_DEFAULT_TOKENS)})"
        if self.model == "gpt2" and self.merges is None:
            return "a byte-level vocabulary without merges"
        if self.model == "llama" and self.merges is None and self.scores is None:
            return "a SentencePiece vocabulary with neither merges nor scores"
        return None

    def build(self):
        """The tokenizer as a `tokenizers.Tokenizer` (call unsupported() first)."""
        from tokenizers import AddedToken, Regex, pre_tokenizers

        tokenizer = _byte_level(self) if self.model == "gpt2" else _sentencepiece(self)
        vocab = tokenizer.get_vocab()
        byte_level = self.model == "gpt2"
        alphabet = set(_bytes_to_unicode().values())
        # Added in transformers' order: the tokenizer class's own special tokens, the tokens the
        # file marks control (in a byte-level vocabulary, only those spelled in its alphabet:
        # the others are llama.cpp mislabels), then its named special tokens.
        special = [t for t in _CLASS_DEFAULT_TOKENS[self.model] if t in vocab]
        special += [
            token
            for token, kind in zip(self.tokens, self.token_types, strict=False)
            if kind == _CONTROL and (not byte_level or set(token) <= alphabet)
        ]
        special += [t for t in self.special_tokens.values() if t is not None]
        tokenizer.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)]
        )
        user_defined = [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(self.tokens, self.token_types, strict=False)
            if kind == _USER_DEFINED and token in vocab
        ]
        if user_defined:
            tokenizer.add_tokens(user_defined)
        split = PRE_TOKENIZER_SPLITS.get(self.pre or "")
        if split is not None:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tokenizer.post_processor = self._post_processor(tokenizer)
        return tokenizer

    def _post_processor(self, tokenizer):
        """BOS/EOS around each sequence, as transformers' update_post_processor writes it."""
        from tokenizers import processors

        bos, eos = self.special_tokens["bos_token"], self.special_tokens["eos_token"]
        add_bos = self.add_bos_token and bos is not None
        add_eos = self.add_eos_token and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1"
        pair += f" {eos}:1" if add_eos else ""
        special = []
        if add_bos:
            special.append((bos, tokenizer.token_to_id(bos)))
        if add_eos:
            special.append((eos, tokenizer.token_to_id(eos)))
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json as transformers saves it (its BOS/EOS flags live in
        tokenizer.json's post-processor; the chat template in chat_template.jinja)."""
        config: dict[str, Any] = {
            "backend": "tokenizers",
            "model_max_length": _VERY_LARGE_INTEGER,
            "tokenizer_class": "TokenizersBackend",
        }
        config.update({k: v for k, v in self.special_tokens.items() if v is not None})
        return config

    def save(self, directory: Path) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja into `directory`."""
        self.build().save(str(directory / "tokenizer.json"))
        config = json.dumps(self.tokenizer_config(), indent=2, sort_keys=True)
        (directory / "tokenizer_config.json").write_text(config)
        if self.chat_template is not None:
            (directory / "chat_template.jinja").write_text(self.chat_template)


def _byte_level(gguf: GGUFTokenizer):
    """GPT-2's byte-level BPE (transformers' GPT2Tokenizer): tokens the file spells in plain
    UTF-8 are respelled in the byte alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(gguf.tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocab[token] = index
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(merge.split(" ")) for merge in gguf.merges or ()],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(gguf: GGUFTokenizer):
    """SentencePiece BPE with byte fallback (transformers' LlamaTokenizer, legacy=False): "▁"
    for spaces, prepended to the first word only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(gguf.tokens)}
    if gguf.merges is not None:
        merges = [tuple(merge.split(" ")) for merge in gguf.merges]
    else:
        merges = _merges_from_scores(vocab, dict(zip(gguf.tokens, gguf.scores or (), strict=False)))
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces of
    the vocabulary, best score first (transformers' generate_merges, order for order)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (spaces as "Ġ", ...)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
