"""AsyncLLM: the engine for asyncio callers (the API server), one EngineClient of several.

    async for output in async_llm.generate(prompt, params, request_id): ...

The engine runs in a background thread (core/supervisor.py runs core/engine_core.py's loop);
`generate` posts an AddRequest whose sink hands each RequestOutput to the caller's asyncio queue
with `call_soon_threadsafe`. Requests from all callers share the engine's batches. When a caller
stops listening (a client disconnects), its request is aborted and its KV blocks are freed,
whenever that happens: before the engine took the request (it is then never added), while it is
added, or mid-stream. If the engine fails, every waiting caller gets EngineDeadError, later calls
get it at once (or EngineRestartingError while --restart-on-failure builds a new engine), and
`health_error()` says why for /health.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable

from llmctl.engine.client.protocol import Supervision
from llmctl.engine.core.engine_core import AbortRequest, AddRequest, EngineCore
from llmctl.engine.core.llm_engine import EngineStats, LLMEngine, PromptType
from llmctl.engine.core.supervisor import EngineSupervisor
from llmctl.engine.errors import EngineDeadError, InvalidRequestError
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        stall_timeout: float = 0.0,
        restart_on_failure: bool = False,
        max_restarts: int = 3,
        engine_factory: Callable[[], LLMEngine] | None = None,
        restart_backoff_s: float = 1.0,
        lockstep=None,
        replica_index: int = 0,
        _start: bool = True,
    ) -> None:
        """`stall_timeout` (0: off) and `restart_on_failure` as the server's options say;
        restarts build the engine with `engine_factory`. `lockstep`: a DPLockstep of which
        this engine is replica `replica_index`."""
        core = EngineCore(lockstep, replica_index)
        if engine is not None:
            core.attach(engine)
        self.supervisor = EngineSupervisor(
            core,
            stall_timeout=stall_timeout,
            restart_on_failure=restart_on_failure,
            max_restarts=max_restarts,
            engine_factory=engine_factory,
            restart_backoff_s=restart_backoff_s,
        )
        if _start:
            self.supervisor.start()

    @classmethod
    def from_engine_args(cls, engine_args, progress=None) -> AsyncLLM:
        """Build the engine in the engine thread itself (one OpenMP team: see
        core/supervisor.py). Raises what building the engine raised."""
        self, built = cls.start_building(
            lambda: LLMEngine.from_engine_args(engine_args, progress),
            rebuild=lambda: LLMEngine.from_engine_args(engine_args),
            stall_timeout=engine_args.stall_timeout,
            restart_on_failure=engine_args.restart_on_failure,
            max_restarts=engine_args.max_restarts,
        )
        built.result()
        return self

    @classmethod
    def start_building(
        cls,
        build: Callable[[], LLMEngine],
        thread_name: str = "llmctl-engine",
        rebuild: Callable[[], LLMEngine] | None = None,
        **options,
    ) -> tuple[AsyncLLM, concurrent.futures.Future]:
        """Start a thread that runs `build()` (returning an LLMEngine), then serves it; the
        future is done once it is built (or holds what building raised). `options`: the
        constructor's stall, restart and lockstep keywords; a restart builds with `rebuild`
        (or `build`)."""
        self = cls(engine_factory=rebuild or build, _start=False, **options)
        return self, self.supervisor.start_building(build, thread_name)

    # -- EngineClient ----------------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine | None:
        """The engine being served (its config and tokenizer are what the server reads)."""
        return self.supervisor.engine

    @property
    def is_running(self) -> bool:
        return self.health_error() is None

    def health_error(self) -> EngineDeadError | None:
        """Why the engine cannot serve (None while it can): dead, restarting, or stalled."""
        return self.supervisor.health_error()

    def health(self) -> dict:
        """/health's body while the engine serves."""
        last = self.supervisor.last_failure
        return {
            "status": "ok",
            "restarts": self.supervisor.restarts,
            "last_failure": None if last is None else last.message,
        }

    def get_stats(self) -> EngineStats:
        """The engine's counters as of its last step (read without stopping the engine)."""
        return self.supervisor.core.stats

    def replica_states(self) -> list[tuple[int, EngineStats, EngineDeadError | None]]:
        """(replica index, stats, why it cannot serve or None), for /metrics and /health; one
        replica here (see DPAsyncLLM)."""
        return [(0, self.get_stats(), self.health_error())]

    def supervision(self) -> list[Supervision]:
        s = self.supervisor
        stalled = s.stall_error is not None or s.monitor.stalled()
        return [Supervision(s.monitor.seconds_waiting(), stalled, s.restarts)]

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        on_accepted=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs as the engine produces them, the last finished.

        Raises InvalidRequestError before the first output if the engine rejects the request,
        EngineDeadError if the engine dies. Closing the iterator early aborts the request.
        `on_accepted()` is called once the engine took the request (an error before it means
        the request never ran).
        """
        supervisor = self.supervisor
        unavailable = supervisor.dead_error or supervisor.restarting
        if unavailable is not None:
            raise unavailable
        stream: asyncio.Queue = asyncio.Queue()
        command = AddRequest(request_id, prompt, params, _asyncio_sink(stream))
        finished = False
        supervisor.post(command)
        try:
            # Raises the engine's validation error. If the caller is cancelled here, the engine
            # either never adds the request or adds it before the abort posted below.
            await asyncio.wrap_future(command.accepted)
            if on_accepted is not None:
                on_accepted()
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        except InvalidRequestError:
            finished = True  # never added: nothing to abort
            raise
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.supervisor.post(AbortRequest(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        self.supervisor.shutdown(timeout)

    # -- supervision, as /health, /metrics and the data-parallel client read it ----------------

    def request_stop(self) -> None:
        self.supervisor.request_stop()

    @property
    def monitor(self):
        return self.supervisor.monitor

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.supervisor.dead_error

    @property
    def restarting(self):
        return self.supervisor.restarting

    @property
    def stall_error(self):
        return self.supervisor.stall_error

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts


def _asyncio_sink(stream: asyncio.Queue) -> Callable[[object], None]:
    """A sink for the engine thread that puts each item on `stream` in its own event loop."""
    loop = asyncio.get_running_loop()

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    return put
