"""IncrementalDetokenizer: token ids -> text as they arrive, and the stop-string check.

Each new token is decoded together with the few tokens before it (a short window, not the whole
output), so multi-byte characters split across tokens and tokenizers that drop leading spaces
decode as they would in one piece; text ending in an incomplete character waits for the next token.
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
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self.num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Append tokens; return the stop string that ended the text, if one did."""
        if self.tokenizer is None:
            return None  # no text, hence no stop strings (the engine refuses them)
        for token_id in new_token_ids:
            self.ids.append(token_id)
            self.num_output_tokens += 1
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset :])
            if len(new_text) <= len(prefix_text) or (
                new_text.endswith(_INCOMPLETE) and not finished
            ):
                continue
            searched_from = len(self.output_text)
            self.output_text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            stop = self._check_stop_strings(searched_from)
            if stop is not None:
                return stop
        return None

    def _check_stop_strings(self, new_text_start: int) -> str | None:
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        for stop in self.stop:
            start = max(0, new_text_start - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1:
                self.output_text = self.output_text[:index]  # stop strings are never included
                return stop
        return None

    def get_text(self, finished: bool) -> str:
        if finished or self.stop_buffer == 0:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self.stop_buffer, 0)]
