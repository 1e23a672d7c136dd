"""IncrementalDetokenizer: token ids -> text as they arrive, and the stop-string check.

Each new token costs one decode of a short window, whatever the output's length:
- with a fast tokenizer whose decode adds nothing to its `tokenizers` backend's (no
  clean_up_tokenization_spaces), the backend's DecodeStream, primed with the last prompt tokens,
  turns each token into its new text (None while a character is split across tokens);
- otherwise the token is decoded with the few before it (a window that restarts after each piece
  of text), so multi-byte characters split across tokens and tokenizers that drop leading spaces
  decode as they would in one piece; text ending in an incomplete character waits for the next
  token.
The text is kept as a list of pieces (appending to one long string copies it each time): the
stop-string check reads only its tail, and a streamed delta only its new pieces.
Without a tokenizer (skip_tokenizer_init) nothing is decoded: the text stays "".
"""

from __future__ import annotations

from typing import Any

from llmctl.engine.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        # While streaming, hold back text that may be the start of a stop string.
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1
        self.num_output_tokens = 0
        self.decoded_tokens = 0  # ids passed to the tokenizer's decoding, for the work counters
        self._pieces: list[str] = []
        self.length = 0  # characters of text so far
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._stream = _decode_stream(tokenizer, context, self.skip_special_tokens)
        self._pending: list[int] = []  # ids the stream has taken and not yet turned into text
        # the window method's state
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    @property
    def output_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Append tokens; return the stop string that ended the text, if one did."""
        if self.tokenizer is None:
            return None  # no text, hence no stop strings (the engine refuses them)
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.num_output_tokens += 1
            text = self._next_text(token_id, finished and i == last)
            if not text:
                continue
            searched_from = self.length
            self._pieces.append(text)
            self.length += len(text)
            stop = self._check_stop_strings(searched_from)
            if stop is not None:
                return stop
        return None

    def _next_text(self, token_id: int, last: bool) -> str:
        """The text `token_id` adds (one decode); "" while it ends in a split character."""
        if self._stream is not None:
            stream, backend = self._stream
            self.decoded_tokens += 1
            text = stream.step(backend, token_id)
            if text is None:
                self._pending.append(token_id)
                if not last:
                    return ""
                # the output ends inside a character: shown as one decode shows it
                text = self.tokenizer.decode(
                    self._pending, skip_special_tokens=self.skip_special_tokens
                )
            self._pending = []
            return text
        self.ids.append(token_id)
        window = self.ids[self.prefix_offset :]
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_INCOMPLETE) and not last):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop_strings(self, new_text_start: int) -> str | None:
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, new_text_start - longest + 1)
        tail = self.text_between(start, self.length)
        for stop in self.stop:
            index = tail.find(stop)
            if index != -1:  # stop strings are never included
                self._pieces = [self.output_text[: start + index]]
                self.length = start + index
                return stop
        return None

    def visible_length(self, finished: bool) -> int:
        """Characters that may be shown: all once finished, else all but a possible stop
        string's start."""
        if finished or self.stop_buffer == 0:
            return self.length
        return max(self.length - self.stop_buffer, 0)

    def text_between(self, start: int, end: int) -> str:
        """Characters [start, end) of the text, read from its last pieces (O(end - start) for
        a recent range)."""
        if start >= end:
            return ""
        pieces, position = [], self.length
        for piece in reversed(self._pieces):
            if position <= start:
                break
            pieces.append(piece)
            position -= len(piece)
        joined = "".join(reversed(pieces))
        return joined[start - position : end - position]

    def get_text(self, finished: bool) -> str:
        return self.text_between(0, self.visible_length(finished))


def _decode_stream(tokenizer: Any | None, context: list[int], skip_special_tokens: bool):
    """(DecodeStream primed with `context`, its backend), where the tokenizer's decode is its
    `tokenizers` backend's alone; else None (the window method)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "_backend", None)  # LightTokenizer
    clean_up = getattr(tokenizer, "_clean_up_spaces", None)
    if backend is None:  # transformers' fast tokenizers
        backend = getattr(tokenizer, "backend_tokenizer", None)
        clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", None)
    if backend is None or clean_up or not hasattr(tokenizer, "decode"):
        return None
    try:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):  # tokenizers < 0.22: no priming with ids
        return None
    return stream, backend
