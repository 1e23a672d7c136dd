"""AsyncLLM: the engine driven by a background thread, for asyncio callers (the API server).

The engine is not thread-safe, so only its own thread touches it: callers post commands (add,
abort) to a queue and wake the thread; the thread runs `step()` while work remains and hands each
RequestOutput to the caller's asyncio queue with `call_soon_threadsafe`. Requests from all
clients share the engine's batches. When a caller stops listening (a client disconnects), its
request is aborted and its KV blocks are freed, whenever that happens: before the engine took the
request (it is then never added), while it is added, or mid-stream. If anything in the engine
thread raises (a worker process died, a bug), the thread stops serving: every waiting caller gets
EngineDeadError, later calls get it at once, and `dead_error` stays set for /health.

Supervision (the server's --stall-timeout, --restart-on-failure): the engine thread tells a
StallMonitor when it steps; a Watchdog thread (engine/core/watchdog.py) declares the engine stalled
when it has work and no step completed for `stall_timeout` seconds, names the ranks the executor
still waits for, and aborts the executor (its workers are killed; the engine thread's wait raises
EngineStalledError); it also fails an idle engine whose worker died.
With `restart_on_failure`, a failure (a stall, a dead worker, a bug) does not end the engine: the
requests in flight get the error, the engine and its workers are stopped, and after a backoff
(1, 2, 4, ... s) a new engine is built in the same thread, up to `max_restarts` times; meanwhile
new requests and /health get EngineRestartingError.

A caller's acceptance future is claimed by the engine thread with
`set_running_or_notify_cancel()` before the request is added: from then on the caller can no
longer cancel it (its abort goes through the command queue, behind the add), and until then a
caller that went away leaves a cancelled future the engine skips.

Data-parallel replicas whose MoE layers share experts (engine/dp/lockstep.py) pass a DPLockstep:
each loop turn then agrees with the other replicas' on whether to step, and a failure of this
engine stops theirs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from llmctl.engine.core.llm_engine import EngineStats, LLMEngine, PromptType
from llmctl.engine.core.stall_monitor import StallMonitor, restart_delay, stalled_error
from llmctl.engine.core.watchdog import Watchdog
from llmctl.engine.errors import (
    EngineDeadError,
    EngineRestartingError,
    EngineStalledError,
    InvalidRequestError,
)
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
        self.engine = engine
        self.lockstep = lockstep
        self.replica_index = replica_index
        if lockstep is not None:
            lockstep.attach(replica_index, self)
        self.dead_error: EngineDeadError | None = None
        self.restarting: EngineRestartingError | None = None  # set while a restart is under way
        self.stall_error: EngineStalledError | None = None  # the stall being torn down
        self._aborted: EngineDeadError | None = None  # the watchdog's verdict, for the loop
        self.restarts = 0
        self.last_failure: EngineDeadError | None = None  # what the last restart recovered from
        self.monitor = StallMonitor(stall_timeout)
        self.max_restarts = max_restarts if restart_on_failure and engine_factory else 0
        self._engine_factory = engine_factory
        self._restart_backoff_s = restart_backoff_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stopping = False
        self._lock = threading.Lock()  # orders posting against the engine's death
        self._stats = engine.get_stats() if engine is not None else None
        self._thread = threading.Thread(target=self._run, name="llmctl-engine", daemon=True)
        self._watchdog = Watchdog(self)
        if _start:
            self._start_threads()

    @classmethod
    def from_engine_args(cls, engine_args, progress=None) -> AsyncLLM:
        """Build the engine in the engine thread itself: torch then runs all its work from one
        thread, so the process has one OpenMP thread team. (A second team, from loading in the
        main thread, made the CPU's two cores oversubscribed: OpenMP then stops spinning between
        ops and decoding ran about 25% slower.) Raises what building the engine raised."""
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
        constructor's stall and restart keywords; a restart builds with `rebuild` (or `build`)."""
        self = cls(engine_factory=rebuild or build, _start=False, **options)
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
        self._start_threads()
        return self, built

    def _start_threads(self) -> None:
        self._thread.start()
        if self.monitor.timeout_s > 0:
            self._watchdog.start()

    @property
    def is_running(self) -> bool:
        return self.health_error() is None

    def health_error(self) -> EngineDeadError | None:
        """Why the engine cannot serve (None while it can): dead, restarting, or stalled."""
        if self.dead_error is not None:
            return self.dead_error
        if self.lockstep is not None and self.lockstep.failure is not None:
            return self.lockstep.failure  # stopping with the replica that failed
        if self.restarting is not None:
            return self.restarting
        if not self._thread.is_alive():
            return EngineDeadError("the engine thread stopped", "restart the server")
        if self.stall_error is not None:
            return self.stall_error
        if self.monitor.stalled():  # before the watchdog's next look
            return self.stalled_error()
        return None

    def health(self) -> dict:
        """/health's body while the engine serves."""
        last = self.last_failure
        return {
            "status": "ok",
            "restarts": self.restarts,
            "last_failure": None if last is None else last.message,
        }

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
        unavailable = self.dead_error or self.restarting
        if unavailable is not None:
            raise unavailable
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

    def wake(self) -> None:
        """Have the engine thread look for work now (another replica of its lockstep has)."""
        self._wakeup.set()

    def request_stop(self) -> None:
        """Tell the loop to stop, without waiting (shutdown() waits)."""
        self._stopping = True
        self._wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; the engine thread then shuts the engine down itself (Ray, for one,
        expects the thread that started it to stop it)."""
        self.request_stop()
        self._thread.join(timeout)
        if self._thread.is_alive() and self.engine is not None:
            logger.warning("the engine thread did not stop within %.0f s", timeout)
            self.engine.shutdown()

    # -- the engine thread ---------------------------------------------------------------------

    def _post(self, command) -> None:
        with self._lock:
            unavailable = self.dead_error or self.restarting
            if unavailable is not None:
                if isinstance(command, _Add):
                    command.accepted.set_exception(unavailable)
                return
            self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        """Serve until shutdown(); after a failure, restart the engine while restarts are left."""
        while (error := self._serve()) is not None and self._restart(error):
            pass

    def _serve(self) -> EngineDeadError | None:
        """Run the loop on the current engine; returns its failure (None: stopped on request),
        once the engine is shut down and the requests in flight got the failure (in that order:
        a caller that has its error finds no worker left)."""
        error = None
        try:
            self._loop()
        except EngineDeadError as exc:
            error = exc
        except BaseException as exc:  # a bug: report it to every caller, stop serving
            logger.exception("the engine thread failed")
            error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            executor = getattr(self.engine, "executor", None)
            if executor is not None:  # a failure, not a stop: the other nodes' agents are told
                executor.abort(error)
        finally:
            if error is not None and self.lockstep is not None:
                self.lockstep.fail(error, self.replica_index)  # the others stop too, now
            try:
                self.engine.shutdown()
            finally:
                if error is not None:
                    self.fail_all(error)
        return error

    def _loop(self) -> None:
        engine = self.engine
        monitor = self.monitor
        stepped = False  # since the engine was last idle
        while not self._stopping and self.dead_error is None:
            if self._aborted is not None:  # a worker died while the engine was idle
                raise self._aborted
            self._drain_commands()
            busy = engine.has_unfinished_requests()
            if self.lockstep is not None:  # every replica steps, or none
                busy = self.lockstep.sync(self.replica_index, busy, self.failure_in_hand)
            if not busy:
                if stepped:  # the last request just finished: the steps' heap back (a call
                    stepped = False  # to every worker, watched for stalls as a step is)
                    engine.release_idle_memory()
                    continue  # look for requests that came meanwhile before waiting
                monitor.idle()
                self._wakeup.wait(_IDLE_CHECK_S)
                self._wakeup.clear()
                engine.check_alive()  # a worker that died while idle fails the engine now
                continue
            monitor.busy()
            stepped = True
            outputs = engine.step()
            monitor.step_completed()
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
        entry = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if entry is None:
            return
        stream, loop = entry
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def fail_all(self, error: EngineDeadError, may_restart: bool = True) -> None:
        """Give `error` to every request in flight and every one posted; the engine is then
        restarting while restarts are left, else dead. The engine thread calls it, or the
        watchdog when the engine thread is stuck."""
        with self._lock:
            if self.dead_error is not None:  # the watchdog already failed everyone
                return
            restart = may_restart and self.restarts < self.max_restarts and not self._stopping
            if restart:
                self.restarting = EngineRestartingError(
                    f"the engine is restarting (restart {self.restarts + 1} of "
                    f"{self.max_restarts}) after: {error.message}",
                    "retry in a few seconds",
                )
            else:
                self.dead_error = error
                self.restarting = None
            self.stall_error = None
            self._aborted = None
        logger.error("engine %s: %s", "failed" if restart else "stopped", error.message)
        self.monitor.idle()
        for request_id in list(self._streams):
            self._deliver(request_id, error, last=True)
        for command in self._pending_commands():  # posted before the failure was known
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)

    def _restart(self, failure: EngineDeadError) -> bool:
        """After the backoff, build a new engine; False when no restart is due (the engine is
        dead) or shutdown() came first."""
        while self.restarting is not None:
            self.restarts += 1
            delay = restart_delay(self.restarts, self._restart_backoff_s)
            logger.warning(
                "restarting the engine in %.0f s (restart %d of %d)",
                delay,
                self.restarts,
                self.max_restarts,
            )
            if self._sleep(delay):
                return False
            self.engine = None  # the old one's memory goes before the new one loads
            try:
                engine = self._engine_factory()
            except BaseException as exc:
                logger.debug("restarting the engine failed", exc_info=True)
                if not isinstance(exc, EngineDeadError):
                    exc = EngineDeadError(
                        f"restarting the engine failed: {type(exc).__name__}: {exc}",
                        "see the server's log",
                    )
                self.fail_all(exc)
                continue
            self.engine = engine
            self._stats = engine.get_stats()
            self.last_failure = failure
            with self._lock:
                self.restarting = None
            logger.warning("engine restarted (restart %d of %d)", self.restarts, self.max_restarts)
            return True
        return False

    def _sleep(self, seconds: float) -> bool:
        """Wait `seconds` unless shutdown() comes first; True if it did."""
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._wakeup.wait(left)
            self._wakeup.clear()
        return self._stopping

    # -- for the watchdog thread (engine/core/watchdog.py) ---------------------------------------

    def abort_engine(self, error: EngineDeadError) -> None:
        """Fail the engine from another thread: its executor stops the workers and raises
        `error` in the engine thread's wait, or the engine thread's loop raises it when idle."""
        self._aborted = error
        executor = getattr(self.engine, "executor", None)
        if executor is not None:
            executor.abort(error)
        self._wakeup.set()

    def stalled_error(self) -> EngineStalledError:
        return stalled_error(self.monitor, getattr(self.engine, "executor", None))

    @property
    def stopping(self) -> bool:
        return self._stopping

    def failure_in_hand(self) -> bool:
        """True while shutting down, or while a failure is being handled."""
        return bool(self._stopping or self.restarting or self.stall_error or self._aborted)
