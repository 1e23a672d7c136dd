"""LLM: the offline API, in the shape vLLM users know.

from llmctl.engine import LLM, SamplingParams
llm = LLM()  # the bundled SmolLM2-135M-Instruct
outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from llmctl.engine.client.factory import build_engine_client
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.core.llm_engine import PromptType
from llmctl.engine.errors import ConfigError, InvalidRequestError, RequestBatchError
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.progress import configure_default_logging, generation_progress, rich_progress
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    """A model loaded for offline generation.

    Keywords are those of EngineArgs: model (None: the bundled default), dtype ("auto"),
    max_model_len, kv_cache_space_gib, block_size (16), max_num_seqs, max_num_batched_tokens,
    seed (0), enable_prefix_caching (True), tensor_parallel_size, pipeline_parallel_size,
    distributed_executor_backend, pipeline_layer_partition, num_gpu_blocks_override, tokenizer
    (a directory; default: the model's), skip_tokenizer_init (False), data_parallel_size (1: N
    replicas, each its own workers and KV cache, the batch routed among them as the server does;
    with enable_expert_parallel on a mixture of experts, the replicas' MoE layers share the
    experts over DP x TP ranks and the replicas step together: engine/dp/lockstep.py).

    skip_tokenizer_init=True loads no tokenizer, so a model directory needs no tokenizer files:
    prompts must then be token ids (a list of ints or {"prompt_token_ids": [...]}), outputs carry
    token_ids and text "", logprobs have decoded_token None, stop strings and chat() are refused,
    and EOS ids come from the model's generation_config.json and config.json.
    """

    def __init__(self, model: str | None = None, *, use_tqdm_on_load: bool = True, **kwargs):
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES)
        if unknown:
            raise ConfigError(
                f"unknown LLM() argument(s): {', '.join(unknown)}",
                f"valid arguments: {', '.join(sorted(_ENGINE_ARG_NAMES - {'model'}))}",
            )
        configure_default_logging()
        engine_args = EngineArgs(model=model, **kwargs)
        if use_tqdm_on_load:
            with rich_progress() as progress:
                client = build_engine_client(engine_args, progress, inproc=True)
        else:
            client = build_engine_client(engine_args, inproc=True)
        self.engine_client = client
        # The engine (with data parallelism, replica 0's: its config and tokenizer).
        self.llm_engine = client.engine
        # Dropped without shutdown(): the workers stop when this LLM is collected, or at exit.
        self._finalizer = weakref.finalize(self, client.shutdown)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer; None when it was started with skip_tokenizer_init."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a batch, in the order given.

        A prompt is text, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}.
        Invalid prompts do not stop the others: with one prompt its error is raised; with
        several, RequestBatchError is raised after the valid ones finished and carries their
        outputs.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"{len(params_list)} SamplingParams for {len(prompt_list)} prompts",
                    "pass one SamplingParams, or one per prompt",
                )
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.apply_chat_template(conversation, add_generation_prompt, chat_template)
            # The template writes the special tokens itself: none are added when encoding.
            ids = self.llm_engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of `conversation`."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                "chat needs a tokenizer (for the chat template and to encode its text), but this "
                "engine was started with skip_tokenizer_init",
                "apply the chat template yourself and pass the token ids to generate(), or "
                "start the engine without skip_tokenizer_init",
                param="messages",
            )
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model's tokenizer has no chat template",
                "use generate() with a plain prompt, or pass chat_template=",
                param="messages",
            )
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )

    def shutdown(self) -> None:
        self._finalizer()  # once: the engine client's shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Every prompt at once through the engine client, as the server runs them; the
        results in the prompts' order."""
        client = self.engine_client
        ids = [str(next(self._ids)) for _ in prompts]
        # One output per request, when it finishes: no per-step copies or text (vLLM's LLM too).
        params = [p.replace(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        with generation_progress(use_tqdm, len(prompts)) as advance:

            async def one(prompt: PromptType, p: SamplingParams, request_id: str):
                final = None
                async for output in client.generate(prompt, p, request_id):
                    final = output
                advance(final)
                return final

            async def run_all() -> list:
                tasks = [one(*args) for args in zip(prompts, params, ids, strict=True)]
                return await asyncio.gather(*tasks, return_exceptions=True)

            gathered = _run_to_completion(run_all())
        errors: dict[int, InvalidRequestError] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, result in enumerate(gathered):
            if isinstance(result, InvalidRequestError):
                errors[i] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                results[i] = result
        if errors:
            if len(prompts) == 1:
                raise errors[0]
            raise RequestBatchError(errors, results)
        return results  # type: ignore[return-value]


def _run_to_completion(coroutine):
    """asyncio.run, also from a thread whose event loop is running (a notebook's): then in a
    thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)
