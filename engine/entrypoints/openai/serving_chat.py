"""POST /v1/chat/completions: the conversation goes through the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from llmctl.engine.entrypoints.openai.protocol import ChatCompletionRequest
from llmctl.engine.entrypoints.openai.serving import (
    HeldDelta,
    OpenAIServing,
    Prepared,
    new_id,
    sse,
    sse_error,
    usage,
)
from llmctl.engine.errors import InvalidRequestError


class ChatHandler(OpenAIServing):
    request_type = ChatCompletionRequest

    def prepare_body(self, body: ChatCompletionRequest) -> Prepared:
        params = body.sampling_params()
        if self.tokenizer is None:
            raise InvalidRequestError(
                "chat needs the model's tokenizer and chat template, and this server runs "
                "without a tokenizer (--skip-tokenizer-init)",
                "send token ids to /v1/completions",
                param="messages",
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template",
                "use /v1/completions with a plain prompt",
                param="messages",
            )
        conversation = [m.as_template_input() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as exc:  # the template rejects the conversation (jinja raise_exception)
            raise InvalidRequestError(
                f"the chat template rejected the messages: {exc}",
                "check the roles and their order",
                param="messages",
            ) from exc
        prompt = self.tokenize(text, body.add_special_tokens, "messages")
        self.check_length(prompt, params, "messages")
        return Prepared(body, params, [prompt])

    async def complete(self, prepared: Prepared) -> dict:
        body, params, (prompt,) = prepared.body, prepared.params, prepared.prompts
        request_id = new_id("chatcmpl")
        final = None
        async for _, output in self.run_all([prompt], params, request_id):
            final = output
        choices = []
        for c in final.outputs:
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": (
                    self._logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)
                    if body.logprobs
                    else None
                ),
                "finish_reason": c.finish_reason,
            }
            if self.returns_token_ids(body):
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(prompt.token_ids), completion_tokens),
        }
        if self.returns_token_ids(body):
            response["prompt_token_ids"] = prompt.token_ids
        return response

    async def stream(self, prepared: Prepared) -> AsyncIterator[str]:
        body, params, (prompt,) = prepared.body, prepared.params, prepared.prompts
        request_id = new_id("chatcmpl")
        created = int(time.time())
        sent_tokens: dict[int, int] = {}
        held: dict[int, HeldDelta] = {}  # tokens not sent yet, and their logprobs
        finished: set[int] = set()
        with_ids = self.returns_token_ids(body)
        try:
            for index in range(params.n):  # the role comes first, as OpenAI sends it
                delta = {"role": "assistant", "content": ""}
                yield sse(self._chunk(request_id, created, index, delta, None, None))
            async for _, output in self.run_all([prompt], params, request_id):
                for c in output.outputs:  # deltas (output_kind DELTA)
                    if c.index in finished:
                        continue
                    pending = held.setdefault(c.index, HeldDelta())
                    pending.add(c)
                    if not c.text and c.finish_reason is None:
                        continue  # held back: the tokens go with the next text
                    logprobs = None
                    if body.logprobs:
                        logprobs = self._logprobs(
                            pending.token_ids, pending.logprobs, body.top_logprobs or 0
                        )
                    sent_tokens[c.index] = sent_tokens.get(c.index, 0) + len(pending.token_ids)
                    held[c.index] = HeldDelta()
                    if c.text or (with_ids and pending.token_ids):
                        chunk = self._chunk(
                            request_id, created, c.index, {"content": c.text}, None, logprobs
                        )
                        if with_ids:
                            chunk["choices"][0]["token_ids"] = pending.token_ids
                        yield sse(chunk)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                        yield sse(
                            self._chunk(request_id, created, c.index, {}, c.finish_reason, None)
                        )
            if body.include_usage:
                chunk = {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": usage(len(prompt.token_ids), sum(sent_tokens.values())),
                }
                yield sse(chunk)
        except Exception as exc:
            yield sse_error(exc)
        yield sse("[DONE]")

    def _chunk(self, request_id, created, index, delta, finish_reason, logprobs) -> dict:
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ],
        }

    def _logprobs(self, token_ids: list[int], entries: list | None, top_k: int) -> dict:
        """OpenAI's chat logprobs for these tokens, each with its top_k."""

        def describe(token: str | None, logprob: float) -> dict:
            token = token or ""
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        content = []
        for token_id, entry in zip(token_ids, entries or [], strict=False):
            chosen = entry[token_id]
            item = describe(chosen.decoded_token, chosen.logprob)
            top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
            item["top_logprobs"] = [describe(lp.decoded_token, lp.logprob) for lp in top]
            content.append(item)
        return {"content": content}
