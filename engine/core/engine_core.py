"""EngineCore: one LLMEngine's busy loop: drain the commands, step, hand each output to its sink.

    while not stopping:
        drain()                  # AddRequest / AbortRequest / FinishStopped, from any thread
        busy = has work          # (with a DPLockstep: every replica steps, or none)
        if busy: step()          # its token ids go to the output thread, which delivers each
        else: wait for a command #   RequestOutput to its request's sink (core/output_thread.py)

The engine is not thread-safe, so only the thread running `loop` touches it; other threads only
`post` commands. A command carries a plain callable (`sink`) that receives the request's outputs
(and, on a failure, the error): the core knows nothing of asyncio or HTTP (the clients do:
client/async_llm.py turns a sink into an asyncio queue). An AddRequest's acceptance future is
claimed with `set_running_or_notify_cancel()` before the request is added: from then on its caller
can no longer cancel it (its abort is posted behind the add), and until then a caller that went
away leaves a cancelled future the core skips.

The loop ends by returning (a stop was asked) or by raising (EngineDeadError: a worker died, the
watchdog aborted a stall, a lockstep partner failed; anything else: a bug). The supervisor
(core/supervisor.py) decides what follows.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from llmctl.engine.core.llm_engine import EngineStats, LLMEngine, PromptType
from llmctl.engine.core.output_thread import OutputThread
from llmctl.engine.core.stall_monitor import StallMonitor
from llmctl.engine.errors import EngineDeadError, InvalidRequestError
from llmctl.engine.sampling_params import SamplingParams

logger = logging.getLogger("llmctl")

# While idle, the loop looks this often for workers that died (a pidfd poll, no call).
IDLE_CHECK_S = 0.5

Sink = Callable[[object], None]  # receives a RequestOutput, or the error that ends the request


@dataclass
class AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    sink: Sink
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class FinishStopped:
    child_ids: list[str]  # sequences whose text hit a stop string (from the output thread)


class EngineCore:
    def __init__(self, lockstep=None, replica_index: int = 0) -> None:
        """`lockstep`: a DPLockstep (dp/lockstep.py) of which this engine is `replica_index`."""
        self.engine: LLMEngine | None = None
        self.lockstep = lockstep
        self.replica_index = replica_index
        self.stats: EngineStats | None = None  # as of the last step, for other threads
        self.wakeup = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self.outputs: OutputThread | None = None  # the attached engine's output thread

    def attach(self, engine: LLMEngine) -> None:
        if self.outputs is not None:  # a restarted engine: the old one's thread is done
            self.outputs.stop()
        self.engine = engine
        self.stats = engine.get_stats()
        processor = getattr(engine, "output_processor", None)  # (a test's scripted engine: none)
        if processor is None:
            self.outputs = None
            return
        self.outputs = OutputThread(
            processor,
            deliver=lambda output: self.deliver(output.request_id, output, output.finished),
            finish=lambda child_ids: self.post(FinishStopped(child_ids)),
            fail=lambda request_id, error: self.deliver(request_id, error, last=True),
        )

    def post(self, command: AddRequest | AbortRequest | FinishStopped) -> None:
        self._commands.put(command)
        self.wakeup.set()

    # -- the loop (its own thread) ---------------------------------------------------------------

    def loop(
        self,
        monitor: StallMonitor,
        stopping: Callable[[], bool],
        aborted: Callable[[], EngineDeadError | None],
        failure_in_hand: Callable[[], bool],
    ) -> None:
        """Serve until `stopping()`; raises the engine's failure. `aborted()` is the watchdog's
        verdict on a stall (raised here if it came while the engine was idle)."""
        try:
            self._loop(monitor, stopping, aborted, failure_in_hand)
        finally:  # what the last steps produced reaches its callers before any failure does
            if self.outputs is not None:
                self.outputs.flush(timeout=30)

    def _loop(self, monitor, stopping, aborted, failure_in_hand) -> None:
        engine = self.engine
        stepped = False  # since the engine was last idle
        while not stopping():
            if (error := aborted()) is not None:  # a worker died while the engine was idle
                raise error
            self.drain()
            busy = engine.has_unfinished_requests()
            if self.lockstep is not None:  # every replica steps, or none
                busy = self.lockstep.sync(self.replica_index, busy, failure_in_hand)
            if not busy:
                if stepped:  # the last request just finished: the steps' heap back (a call
                    stepped = False  # to every worker, watched for stalls as a step is)
                    engine.release_idle_memory()
                    continue  # look for requests that came meanwhile before waiting
                monitor.idle()
                self.wakeup.wait(IDLE_CHECK_S)
                self.wakeup.clear()
                engine.check_alive()  # a worker that died while idle fails the engine now
                continue
            monitor.busy()
            stepped = True
            # none when the output thread delivers them
            outputs = engine.step(self.outputs) if self.outputs is not None else engine.step()
            monitor.step_completed()
            self.stats = engine.get_stats()
            for output in outputs:
                self.deliver(output.request_id, output, output.finished)

    def drain(self) -> None:
        for command in self.pending():
            if isinstance(command, AddRequest):
                self._add(command)
            elif isinstance(command, FinishStopped):
                self.engine.finish_stopped(command.child_ids)
            else:
                self.engine.abort_request(command.request_id)
                self._sinks.pop(command.request_id, None)
        self.stats = self.engine.get_stats()

    def _add(self, command: AddRequest) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller went away before the engine took the request
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except (InvalidRequestError, EngineDeadError) as exc:
            command.accepted.set_exception(exc)
            if isinstance(exc, EngineDeadError):
                raise
            return
        except Exception as exc:  # a bug on this request's path: fail it, serve on
            logger.exception("adding request %s failed", command.request_id)
            command.accepted.set_exception(exc)
            self.engine.abort_request(command.request_id)
            return
        self._sinks[command.request_id] = command.sink
        command.accepted.set_result(None)

    def pending(self):
        """The commands posted and not yet taken, taken now."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def deliver(self, request_id: str, item: object, last: bool) -> None:
        sink = self._sinks.pop(request_id, None) if last else self._sinks.get(request_id)
        if sink is not None:
            sink(item)

    def fail_requests(self, error: EngineDeadError) -> None:
        """Give `error` to every request in flight and to every AddRequest posted."""
        for request_id in list(self._sinks):
            self.deliver(request_id, error, last=True)
        for command in self.pending():  # posted before the failure was known
            if isinstance(command, AddRequest) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)
