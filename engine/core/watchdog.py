"""Watchdog: the thread beside the supervisor's engine thread that fails an engine which cannot
fail by itself.

A step that never completes (a deadlocked collective, a SIGSTOPped or hung rank) never raises in
the engine thread on its own: the engine thread waits on it forever. (A worker that dies while the
engine is idle is the engine thread's own check: LLMEngine.check_alive between idle waits.) Every
`period` the watchdog asks the StallMonitor; on a stall it records the stall (for /health),
aborts the executor (its workers are killed, the engine thread's wait raises the stall, and the
engine thread fails the requests, then restarts or dies) and, if the engine thread does not come
out within `grace_s` (a step stuck in this process: the uni backend), fails the requests itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmctl.engine.core.supervisor import EngineSupervisor

logger = logging.getLogger("llmctl")

# After aborting a stalled executor, how long the engine thread may take to come out of its wait.
GRACE_S = 5.0


class Watchdog:
    def __init__(self, supervisor: EngineSupervisor, grace_s: float = GRACE_S) -> None:
        self.supervisor = supervisor
        self.grace_s = grace_s
        self.period = min(1.0, supervisor.monitor.timeout_s / 4)
        self._thread = threading.Thread(target=self._run, name="llmctl-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        supervisor = self.supervisor
        while not supervisor.stopping and supervisor.dead_error is None:
            time.sleep(self.period)
            if supervisor.failure_in_hand():
                continue
            try:
                self.look()
            except Exception:  # a bug here must not end the watch
                logger.exception("the engine's watchdog failed")

    def look(self) -> None:
        supervisor = self.supervisor
        if supervisor.monitor.stalled():
            self.tear_down_stall()

    def tear_down_stall(self) -> None:
        supervisor = self.supervisor
        error = supervisor.stalled_error()
        supervisor.stall_error = error
        logger.error("engine stalled: %s", error.message)
        supervisor.abort_engine(error)
        deadline = time.monotonic() + self.grace_s
        while supervisor.stall_error is error and time.monotonic() < deadline:
            time.sleep(0.05)
        if supervisor.stall_error is error:  # stuck in this process: nothing to kill
            supervisor.fail_all(error, may_restart=False)
