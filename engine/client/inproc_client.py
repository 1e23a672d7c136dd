"""InprocClient: one engine driven in the caller's own thread, for `LLM` (vLLM's InprocClient).

    async for output in client.generate(prompt, params, request_id): ...

The same EngineClient as AsyncLLM, without a thread: `generate` adds the request to the engine
at once (so a bad one raises before anything runs), and the first caller that needs an output
steps the engine, in the event loop's thread, until every request in flight has its outputs.
An offline batch has nothing else for that thread to do, and the engine stays an ordinary
LLMEngine that `llm.llm_engine` hands out to callers who step it themselves (when no generate is
running). A request whose caller goes away (a task cancelled, Ctrl-C) is aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from llmctl.engine.client.protocol import Supervision
from llmctl.engine.core.llm_engine import EngineStats, LLMEngine, PromptType
from llmctl.engine.errors import EngineDeadError
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams


class InprocClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._stepping: asyncio.Task | None = None
        self.dead_error: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, engine_args, progress=None) -> InprocClient:
        return cls(LLMEngine.from_engine_args(engine_args, progress))

    # -- EngineClient ----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    def health_error(self) -> EngineDeadError | None:
        return self.dead_error

    def health(self) -> dict:
        return {"status": "ok", "restarts": 0, "last_failure": None}

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def replica_states(self) -> list[tuple[int, EngineStats, EngineDeadError | None]]:
        return [(0, self.get_stats(), self.dead_error)]

    def supervision(self) -> list[Supervision]:
        return [Supervision(0.0, False, 0)]

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, on_accepted=None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, the last finished. InvalidRequestError before any output if the
        engine refuses it; EngineDeadError if a step fails."""
        if self.dead_error is not None:
            raise self.dead_error
        self.engine.add_request(request_id, prompt, params)  # raises InvalidRequestError
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        if on_accepted is not None:
            on_accepted()
        try:
            while True:
                if queue.empty() and self._stepping is None:
                    self._stepping = asyncio.create_task(self._step_all())
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine failed it: nothing left to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.dead_error is None:
                self.engine.abort_request(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._queues.pop(request_id, None)

    def shutdown(self, timeout: float = 30.0) -> None:
        self.engine.shutdown()

    # -- stepping --------------------------------------------------------------------------------

    async def _step_all(self) -> None:
        """Step while requests are in flight, handing each output to its caller's queue; a
        failure goes to every caller."""
        try:
            while self.engine.has_unfinished_requests() and self._queues:
                for output in self.engine.step():
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                await asyncio.sleep(0)  # the callers take their outputs (and may go away)
        except Exception as exc:  # every caller gets it (KeyboardInterrupt ends the loop itself)
            if isinstance(exc, EngineDeadError):
                self.dead_error = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)
        finally:
            self._stepping = None
