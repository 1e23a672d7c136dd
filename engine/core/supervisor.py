"""EngineSupervisor: the thread that runs an EngineCore, and what happens when it fails.

It builds the engine in its own thread (torch then runs all its work from one thread: one OpenMP
team; a second team, from loading in the main thread, left the CPU's two cores oversubscribed
and decoding ~25% slower), runs the core's loop, and on a failure (a stall, a dead worker, a
bug) gives the error to every request in flight and every one posted, shuts the engine down and
its workers with it, and then:
- without restarts: the engine is dead; `dead_error` stays set for /health and new requests.
- with `restart_on_failure` (the server's --restart-on-failure): after a backoff (1, 2, 4, ... s)
  a new engine is built in the same thread, up to `max_restarts` times; meanwhile new requests
  and /health get EngineRestartingError.

Stalls (the server's --stall-timeout): the core tells a StallMonitor when it steps; a Watchdog
thread (core/watchdog.py) declares the engine stalled when it has work and no step completed for
`stall_timeout` seconds, names the ranks the executor still waits for, and aborts the executor
(its workers are killed; the core's wait raises EngineStalledError); it also fails an idle engine
whose worker died. A DPLockstep partner (dp/lockstep.py) that fails aborts this engine the same
way, and this engine's failure stops the partners'.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from llmctl.engine.core.engine_core import AbortRequest, AddRequest, EngineCore
from llmctl.engine.core.llm_engine import LLMEngine
from llmctl.engine.core.stall_monitor import StallMonitor, restart_delay, stalled_error
from llmctl.engine.core.watchdog import Watchdog
from llmctl.engine.errors import EngineDeadError, EngineRestartingError, EngineStalledError

logger = logging.getLogger("llmctl")


class EngineSupervisor:
    def __init__(
        self,
        core: EngineCore,
        *,
        stall_timeout: float = 0.0,
        restart_on_failure: bool = False,
        max_restarts: int = 3,
        engine_factory: Callable[[], LLMEngine] | None = None,
        restart_backoff_s: float = 1.0,
    ) -> None:
        self.core = core
        self.dead_error: EngineDeadError | None = None
        self.restarting: EngineRestartingError | None = None  # set while a restart is under way
        self.stall_error: EngineStalledError | None = None  # the stall being torn down
        self.restarts = 0
        self.last_failure: EngineDeadError | None = None  # what the last restart recovered from
        self.monitor = StallMonitor(stall_timeout)
        self.max_restarts = max_restarts if restart_on_failure and engine_factory else 0
        self._engine_factory = engine_factory
        self._restart_backoff_s = restart_backoff_s
        self._aborted: EngineDeadError | None = None  # the watchdog's verdict, for the loop
        self._stopping = False
        self._lock = threading.Lock()  # orders posting against the engine's death
        self._thread = threading.Thread(target=self._run, name="llmctl-engine", daemon=True)
        self._watchdog = Watchdog(self)
        if core.lockstep is not None:
            core.lockstep.attach(core.replica_index, self)

    @property
    def engine(self) -> LLMEngine | None:
        return self.core.engine

    def start(self) -> None:
        """Serve the engine the core holds."""
        self._start_threads()

    def start_building(
        self, build: Callable[[], LLMEngine], thread_name: str = "llmctl-engine"
    ) -> concurrent.futures.Future:
        """Run `build()` in the engine thread, then serve what it built; the future is done once
        it is built (or holds what building raised)."""
        built: concurrent.futures.Future = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                self.core.attach(build())
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result(None)
            self._run()

        self._thread = threading.Thread(target=build_then_run, name=thread_name, daemon=True)
        self._start_threads()
        return built

    def _start_threads(self) -> None:
        self._thread.start()
        if self.monitor.timeout_s > 0:
            self._watchdog.start()

    # -- what callers see ------------------------------------------------------------------------

    def health_error(self) -> EngineDeadError | None:
        """Why the engine cannot serve (None while it can): dead, restarting, or stalled."""
        lockstep = self.core.lockstep
        if self.dead_error is not None:
            return self.dead_error
        if lockstep is not None and lockstep.failure is not None:
            return lockstep.failure  # stopping with the replica that failed
        if self.restarting is not None:
            return self.restarting
        if not self._thread.is_alive():
            return EngineDeadError("the engine thread stopped", "restart the server")
        if self.stall_error is not None:
            return self.stall_error
        if self.monitor.stalled():  # before the watchdog's next look
            return self.stalled_error()
        return None

    def post(self, command: AddRequest | AbortRequest) -> None:
        with self._lock:
            unavailable = self.dead_error or self.restarting
            if unavailable is not None:
                if isinstance(command, AddRequest):
                    command.accepted.set_exception(unavailable)
                return
            self.core.post(command)

    def wake(self) -> None:
        """Have the engine thread look for work now (another replica of its lockstep has)."""
        self.core.wakeup.set()

    def request_stop(self) -> None:
        """Tell the loop to stop, without waiting (shutdown() waits)."""
        self._stopping = True
        self.core.wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; the engine thread then shuts the engine down itself (Ray, for one,
        expects the thread that started it to stop it)."""
        self.request_stop()
        self._thread.join(timeout)
        if self._thread.is_alive() and self.engine is not None:
            logger.warning("the engine thread did not stop within %.0f s", timeout)
            self.engine.shutdown()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def failure_in_hand(self) -> bool:
        """True while shutting down, or while a failure is being handled."""
        return bool(self._stopping or self.restarting or self.stall_error or self._aborted)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        """Serve until shutdown(); after a failure, restart the engine while restarts are left."""
        while (error := self._serve()) is not None and self._restart(error):
            pass

    def _serve(self) -> EngineDeadError | None:
        """Run the core's loop; returns its failure (None: stopped on request), once the engine
        is shut down and the requests in flight got the failure (in that order: a caller that
        has its error finds no worker left)."""
        error = None
        try:
            self.core.loop(
                self.monitor,
                stopping=lambda: self._stopping or self.dead_error is not None,
                aborted=lambda: self._aborted,
                failure_in_hand=self.failure_in_hand,
            )
        except EngineDeadError as exc:
            error = exc
        except BaseException as exc:  # a bug: report it to every caller, stop serving
            logger.exception("the engine thread failed")
            error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            executor = getattr(self.engine, "executor", None)
            if executor is not None:  # a failure, not a stop: the other nodes' agents are told
                executor.abort(error)
        finally:
            lockstep = self.core.lockstep
            if error is not None and lockstep is not None:
                lockstep.fail(error, self.core.replica_index)  # the others stop too, now
            try:
                self.engine.shutdown()
            finally:
                if self.core.outputs is not None:  # after the loop's flush: nothing is left
                    self.core.outputs.stop()
                if error is not None:
                    self.fail_all(error)
        return error

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
        self.core.fail_requests(error)

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
            self.core.engine = None  # the old one's memory goes before the new one loads
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
            self.core.attach(engine)
            self.last_failure = failure
            with self._lock:
                self.restarting = None
            logger.warning("engine restarted (restart %d of %d)", self.restarts, self.max_restarts)
            return True
        return False

    def _sleep(self, seconds: float) -> bool:
        """Wait `seconds` unless shutdown() comes first; True if it did."""
        deadline = time.monotonic() + seconds
        wakeup = self.core.wakeup
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            wakeup.wait(left)
            wakeup.clear()
        return self._stopping

    # -- for the watchdog thread (core/watchdog.py) and a failing lockstep partner ---------------

    def abort_engine(self, error: EngineDeadError) -> None:
        """Fail the engine from another thread: its executor stops the workers and raises
        `error` in the engine thread's wait, or the engine thread's loop raises it when idle."""
        self._aborted = error
        executor = getattr(self.engine, "executor", None)
        if executor is not None:
            executor.abort(error)
        self.core.wakeup.set()

    def stalled_error(self) -> EngineStalledError:
        return stalled_error(self.monitor, getattr(self.engine, "executor", None))
