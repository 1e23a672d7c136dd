"""POST /v1/completions: text completions, streamed or not, for one or several prompts."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from llmctl.engine.entrypoints.openai.protocol import CompletionRequest
from llmctl.engine.entrypoints.openai.serving import (
    HeldDelta,
    OpenAIServing,
    Prepared,
    PreparedPrompt,
    new_id,
    sse,
    sse_error,
    usage,
)
from llmctl.engine.outputs import CompletionOutput, RequestOutput


class CompletionsHandler(OpenAIServing):
    request_type = CompletionRequest

    def prepare_body(self, body: CompletionRequest) -> Prepared:
        params = body.sampling_params()
        prompts = [self.tokenize(p, body.add_special_tokens, "prompt") for p in body.prompts()]
        for prompt in prompts:
            self.check_length(prompt, params, "prompt")
        return Prepared(body, params, prompts)

    async def complete(self, prepared: Prepared) -> dict:
        body, params, prompts = prepared.body, prepared.params, prepared.prompts
        request_id = new_id("cmpl")
        finals: dict[int, RequestOutput] = {}
        async for index, output in self.run_all(prompts, params, request_id):
            if output.finished:
                finals[index] = output
        choices = []
        completion_tokens = 0
        for index, prompt in enumerate(prompts):
            for completion in finals[index].outputs:
                completion_tokens += len(completion.token_ids)
                choices.append(self._choice(body, prompt, index, completion))
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(sum(len(p.token_ids) for p in prompts), completion_tokens),
        }

    async def stream(self, prepared: Prepared) -> AsyncIterator[str]:
        """The engine's outputs are deltas (output_kind DELTA): each completion's new tokens
        are held until they show text (or ids, with return_token_ids), then sent with it."""
        body, params, prompts = prepared.body, prepared.params, prepared.prompts
        request_id = new_id("cmpl")
        created = int(time.time())
        sent_chars: dict[tuple[int, int], int] = {}  # (prompt, completion) -> characters sent
        sent_tokens: dict[tuple[int, int], int] = {}
        held: dict[tuple[int, int], HeldDelta] = {}  # tokens not sent yet, and their logprobs
        finished: set[tuple[int, int]] = set()
        with_ids = self.returns_token_ids(body)
        try:
            async for p_index, output in self.run_all(prompts, params, request_id):
                for completion in output.outputs:
                    key = (p_index, completion.index)
                    if key in finished:
                        continue  # (with n > 1 its finished output comes again, unchanged)
                    pending = held.setdefault(key, HeldDelta())
                    pending.add(completion)
                    text = completion.text
                    if completion.finish_reason is None and not (
                        text or (pending.token_ids and with_ids)
                    ):
                        continue  # nothing new to show (or held back: a possible stop string)
                    chars = sent_chars.get(key, 0)
                    if key not in sent_chars and body.echo:
                        text = self._prompt_text(prompts[p_index]) + text
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = self._logprobs(pending.token_ids, pending.logprobs, chars)
                    sent_before = sent_tokens.get(key, 0)
                    sent_chars[key] = chars + len(completion.text)
                    sent_tokens[key] = sent_before + len(pending.token_ids)
                    choice = {
                        "index": p_index * params.n + completion.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                    }
                    if with_ids:
                        choice["token_ids"] = pending.token_ids
                        if sent_before == 0:
                            choice["prompt_token_ids"] = prompts[p_index].token_ids
                    held[key] = HeldDelta()
                    if completion.finish_reason is not None:
                        finished.add(key)
                    yield sse(self._chunk(request_id, created, [choice]))
            if body.include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                chunk = self._chunk(request_id, created, [])
                chunk["usage"] = usage(prompt_tokens, sum(sent_tokens.values()))
                yield sse(chunk)
        except Exception as exc:  # the engine died or failed mid-stream: say so in the stream
            yield sse_error(exc)
        yield sse("[DONE]")

    def _chunk(self, request_id: str, created: int, choices: list) -> dict:
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
        }

    def _prompt_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        if self.tokenizer is None:
            return ""  # without a tokenizer, token ids are all there is (return_token_ids)
        return self.tokenizer.decode(prompt.token_ids)

    def _choice(self, body, prompt: PreparedPrompt, p_index: int, completion: CompletionOutput):
        text = completion.text
        if body.echo:
            text = self._prompt_text(prompt) + text
        choice = {
            "index": p_index * body.n + completion.index,
            "text": text,
            "logprobs": (
                self._logprobs(completion.token_ids, completion.logprobs, 0)
                if body.logprobs is not None
                else None
            ),
            "finish_reason": completion.finish_reason,
        }
        if self.returns_token_ids(body):
            choice["prompt_token_ids"] = prompt.token_ids
            choice["token_ids"] = list(completion.token_ids)
        return choice

    def _logprobs(self, token_ids: list[int], entries: list | None, offset: int) -> dict:
        """OpenAI's legacy logprobs object for these tokens, whose text starts at `offset`."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, entry in zip(token_ids, entries or [], strict=False):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            top_logprobs.append(
                {lp.decoded_token: lp.logprob for tid, lp in entry.items() if tid != token_id}
                | {chosen.decoded_token: chosen.logprob}
            )
            text_offset.append(offset)
            offset += len(chosen.decoded_token or "")
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
