"""AsyncLLM: the engine driven by a background thread, for asyncio callers (the API server).

The engine is not thread-safe, so only its own thread touches it: callers post commands (add,
abort) to a queue and wake the thread; the thread runs `step()` while work remains and hands each
RequestOutput to the caller's asyncio queue with `call_soon_threadsafe`. Requests from all
clients share the engine's batches. When a caller stops listening (a client disconnects), its
request is aborted and its KV blocks are freed, whenever that happens: before the engine took the
request (it is then never added), while it is added, or mid-stream. If anything in the engine
thread raises (a worker process died, a bug), the thread stops serving: every waiting caller gets
EngineDeadError, later calls get it at once, and `dead_error` stays set for /health.

A caller's acceptance future is claimed by the engine thread with
`set_running_or_notify_cancel()` before the request is added: from then on the caller can no
longer cancel it (its abort goes through the command queue, behind the add), and until then a
caller that went away leaves a cancelled future the engine skips.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmctl.engine.errors import EngineDeadError, InvalidRequestError
from llmctl.engine.llm_engine import EngineStats, LLMEngine, PromptType
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams

logger = logging.getLogger("llmctl")

# While idle, the engine thread looks this often for workers that died (a pidfd poll, no call).
_IDLE_CHECK_S = 0.5


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    stream: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


class AsyncLLM:
    def __init__(self, engine: LLMEngine | None = None, *, _start: bool = True) -> None:
        self.engine = engine
        self.dead_error: EngineDeadError | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stopping = False
        self._lock = threading.Lock()  # orders posting against the engine's death
        self._stats = engine.get_stats() if engine is not None else None
        self._thread = threading.Thread(target=self._run, name="llmctl-engine", daemon=True)
        if _start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args, progress=None) -> AsyncLLM:
        """Build the engine in the engine thread itself: torch then runs all its work from one
        thread, so the process has one OpenMP thread team. (A second team, from loading in the
        main thread, made the CPU's two cores oversubscribed: OpenMP then stops spinning between
        ops and decoding ran about 25% slower.) Raises what building the engine raised."""
        self, built = cls.start_building(lambda: LLMEngine.from_engine_args(engine_args, progress))
        built.result()
        return self

    @classmethod
    def start_building(
        cls, build, thread_name: str = "llmctl-engine"
    ) -> tuple[AsyncLLM, concurrent.futures.Future]:
        """Start a thread that runs `build()` (returning an LLMEngine), then serves it; the
        future is done once it is built (or holds what building raised)."""
        self = cls(_start=False)
        built: concurrent.futures.Future = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                self.engine = build()
                self._stats = self.engine.get_stats()
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result(None)
            self._run()

        self._thread = threading.Thread(target=build_then_run, name=thread_name, daemon=True)
        self._thread.start()
        return self, built

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def health_error(self) -> EngineDeadError | None:
        """Why the engine cannot serve (None while it can)."""
        if self.dead_error is not None:
            return self.dead_error
        if not self._thread.is_alive():
            return EngineDeadError("the engine thread stopped", "restart the server")
        return None

    def get_stats(self) -> EngineStats:
        """The engine's counters as of its last step (read without stopping the engine)."""
        return self._stats

    def replica_states(self) -> list[tuple[int, EngineStats, EngineDeadError | None]]:
        """(replica index, stats, why it cannot serve or None), for /metrics and /health; one
        replica here (see DPAsyncLLM)."""
        return [(0, self.get_stats(), self.health_error())]

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
        if self.dead_error is not None:
            raise self.dead_error
        stream: asyncio.Queue = asyncio.Queue()
        command = _Add(request_id, prompt, params, stream, asyncio.get_running_loop())
        finished = False
        self._post(command)
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
        self._post(_Abort(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; the engine thread then shuts the engine down itself (Ray, for one,
        expects the thread that started it to stop it)."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        if self._thread.is_alive() and self.engine is not None:
            logger.warning("the engine thread did not stop within %.0f s", timeout)
            self.engine.shutdown()

    # -- the engine thread ---------------------------------------------------------------------

    def _post(self, command) -> None:
        with self._lock:
            if self.dead_error is not None:
                if isinstance(command, _Add):
                    command.accepted.set_exception(self.dead_error)
                return
            self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            self._loop()
        except EngineDeadError as exc:
            self._die(exc)
        except BaseException as exc:  # a bug: report it to every caller, stop serving
            logger.exception("the engine thread failed")
            self._die(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
        finally:
            self.engine.shutdown()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_commands()
            if not engine.has_unfinished_requests():
                self._wakeup.wait(_IDLE_CHECK_S)
                self._wakeup.clear()
                engine.check_alive()  # a worker that died while idle fails the engine now
                continue
            outputs = engine.step()
            self._stats = engine.get_stats()
            for output in outputs:
                self._deliver(output.request_id, output, output.finished)

    def _pending_commands(self):
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for command in self._pending_commands():
            if isinstance(command, _Add):
                if not command.accepted.set_running_or_notify_cancel():
                    continue  # the caller went away before the engine took the request
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params)
                except (InvalidRequestError, EngineDeadError) as exc:
                    command.accepted.set_exception(exc)
                    if isinstance(exc, EngineDeadError):
                        raise
                    continue
                except Exception as exc:  # a bug on this request's path: fail it, serve on
                    logger.exception("adding request %s failed", command.request_id)
                    command.accepted.set_exception(exc)
                    self.engine.abort_request(command.request_id)
                    continue
                self._streams[command.request_id] = (command.stream, command.loop)
                command.accepted.set_result(None)
            else:
                self.engine.abort_request(command.request_id)
                self._streams.pop(command.request_id, None)
        self._stats = self.engine.get_stats()

    def _deliver(self, request_id: str, item, last: bool) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        if last:
            del self._streams[request_id]
        stream, loop = entry
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            self.dead_error = error
        logger.error("engine stopped: %s", error.message)
        for request_id in list(self._streams):
            self._deliver(request_id, error, last=True)
        for command in self._pending_commands():  # posted before the failure was known
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)
