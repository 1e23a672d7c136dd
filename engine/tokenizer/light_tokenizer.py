"""LightTokenizer: a tokenizer.json read with the `tokenizers` library alone, without transformers.

Importing transformers to load a tokenizer costs ~2 s and ~200 MB of resident memory (it pulls in
torch._dynamo, sympy and torch.distributed.tensor), more than the bundled 92 MiB model itself. A
directory that llmctl wrote from a GGUF file (model_loader/gguf.py) holds a tokenizer.json, a
tokenizer_config.json and a chat template, which is everything the engine asks of a tokenizer:
encode, decode, the EOS id, the vocabulary and the chat template. This class answers those with
transformers' semantics (the same ids, text and rendered templates; tests/engine/
test_light_tokenizer.py compares them with AutoTokenizer's).

`LightTokenizer.load(directory)` returns None where the directory needs more than this (no
tokenizer.json, a slow tokenizer class, a tokenizer_config option this class does not model):
the caller then loads AutoTokenizer.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

# tokenizer_config.json keys that change nothing this class does (or that it reads itself).
_UNDERSTOOD_KEYS = frozenset(
    {
        "backend",
        "tokenizer_class",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "additional_special_tokens",
        "extra_special_tokens",
        "added_tokens_decoder",
        "chat_template",
        "clean_up_tokenization_spaces",
        "model_max_length",
        "is_local",
        "local_files_only",
        "model_input_names",
        "padding_side",
        "truncation_side",
        "errors",
        "add_prefix_space",
    }
)
# Classes whose behaviour is the tokenizer.json's own (transformers adds nothing on top).
_PLAIN_CLASSES = frozenset(
    {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"}
)
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class LightTokenizer:
    def __init__(self, backend: Any, config: dict, chat_template: str | None) -> None:
        self._backend = backend
        # tokenizers >= 0.20.1 has encode_batch_fast (no offsets); older ones, encode_batch
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.chat_template = chat_template
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        for name in _SPECIAL:
            setattr(self, name, _token_text(config.get(name)))
        self.eos_token_id = self._id_of(self.eos_token)
        self.bos_token_id = self._id_of(self.bos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        self.unk_token_id = self._id_of(self.unk_token)

    @classmethod
    def load(cls, directory: str | Path) -> LightTokenizer | None:
        path = Path(directory)
        tokenizer_json, config_json = path / "tokenizer.json", path / "tokenizer_config.json"
        if not (tokenizer_json.is_file() and config_json.is_file()):
            return None
        try:
            config = json.loads(config_json.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if not isinstance(config, dict) or config.get("tokenizer_class") not in _PLAIN_CLASSES:
            return None
        if set(config) - _UNDERSTOOD_KEYS or config.get("add_prefix_space"):
            return None
        if (path / "special_tokens_map.json").is_file() or (path / "added_tokens.json").is_file():
            return None  # transformers merges these in: leave them to it
        template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        if not isinstance(template, str | type(None)):
            return None  # a list of named templates
        if template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", template):
            return None  # transformers' assistant-mask extension
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(tokenizer_json))
        except Exception:  # noqa: BLE001 - tokenizers raises bare Exception on a bad file
            return None
        return cls(backend, config, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL while it works (encode holds it: a 5 MB prompt
        # would stop the server's event loop, /health included, for seconds). It keeps no
        # offsets: the same ids in half the time, and the Encoding is freed in ~1 ms where
        # encode_batch's (1.2M tokens' offsets and strings) held the GIL 31 ms to free it.
        (encoding,) = self._encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        variables = {name: getattr(self, name) for name in _SPECIAL}
        variables.update(kwargs)
        text = _compiled(template).render(
            messages=conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


@cache
def _compiled(template: str):
    """The template in a sandbox, with the names Hugging Face chat templates use."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
