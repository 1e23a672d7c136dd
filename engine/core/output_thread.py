"""OutputThread: the output processor, off the engine's step.

    engine thread:  schedule -> run -> scheduler.update_from_output -> submit(core outputs)
    output thread:  process_outputs (detokenize, build RequestOutputs) -> deliver to sinks;
                    a stop string found -> finish(child ids), posted back to the engine thread

The engine thread hands each step's token ids over and goes on to the next step; the output
thread turns them into RequestOutputs meanwhile (it runs while the engine thread waits for the
device, which releases the GIL). A sequence that hit a stop string is finished by a command the
engine thread takes with its next ones, so it may run a step or two more; the output processor
ignores what a finished completion produces. The output processor holds a lock: requests are
added and aborted by the engine thread while this one processes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from llmctl.engine.core.output_processor import OutputProcessor
from llmctl.engine.core.scheduler import EngineCoreOutput
from llmctl.engine.outputs import RequestOutput

logger = logging.getLogger("llmctl")

_STOP = object()


class OutputThread:
    def __init__(
        self,
        processor: OutputProcessor,
        deliver: Callable[[RequestOutput], None],
        finish: Callable[[list[str]], None],
        fail: Callable[[str, BaseException], None],
        name: str = "llmctl-outputs",
    ) -> None:
        """`deliver(output)` hands a RequestOutput to its caller; `finish(child_ids)` tells the
        engine thread which sequences a stop string ended; `fail(request_id, error)` ends a
        request whose outputs could not be processed (a bug)."""
        self.processor = processor
        self.deliver = deliver
        self.finish = finish
        self.fail = fail
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, outputs: list[EngineCoreOutput]) -> None:
        if not outputs:
            return
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(outputs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted was delivered; False on timeout."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        """End the thread once what was submitted is delivered (again: nothing)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while (outputs := self._queue.get()) is not _STOP:
            try:
                request_outputs, stopped = self.processor.process_outputs(outputs)
                if stopped:
                    self.finish(stopped)
                for output in request_outputs:
                    self.deliver(output)
            except Exception as exc:  # a bug: its requests get the error, the others go on
                logger.exception("processing a step's outputs failed")
                for request_id in self.processor.parent_ids([o.request_id for o in outputs]):
                    self.fail(request_id, exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()
