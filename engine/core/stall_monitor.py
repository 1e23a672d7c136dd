"""StallMonitor: is the engine stuck? It has work and no step completed for `timeout_s` seconds.

vLLM's /health says 200 while a decode is deadlocked across ranks; ours asks this monitor. The
engine thread reports what it does (`busy()` before a step, `step_completed()` after it, `idle()`
when no request is left); any other thread reads `seconds_waiting()` and `stalled()` without
stopping it. The wait is counted from the last completed step, or from the moment work arrived
after an idle spell (an idle engine never stalls, however long ago its last step was).

Also here, pure: the words that name what stalls (`describe_stall`: the ranks that have not
answered the current step, their pipeline stage, the worker processes that are stopped), and the
reading of a process's state from /proc/PID/stat ('T': stopped by SIGSTOP).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmctl.engine.errors import EngineStalledError

logger = logging.getLogger("llmctl")


class StallMonitor:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s  # 0: never stalled
        self._clock = clock
        self.last_step_time: float | None = None  # the clock's time of the last completed step
        self._waiting_since: float | None = None  # None while idle

    def busy(self) -> None:
        """The engine has work: start counting, unless it already waits for a step."""
        if self._waiting_since is None:
            self._waiting_since = self._clock()

    def step_completed(self) -> None:
        now = self._clock()
        self.last_step_time = now
        self._waiting_since = now

    def idle(self) -> None:
        self._waiting_since = None

    def seconds_waiting(self) -> float:
        """Seconds the engine has had work without completing a step (0 while idle)."""
        since = self._waiting_since  # one read: the engine thread may change it meanwhile
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def stalled(self) -> bool:
        return self.timeout_s > 0 and self.seconds_waiting() >= self.timeout_s


@dataclass(frozen=True)
class StalledRanks:
    """What an executor knows about the step it waits for: the ranks that have not answered it
    (empty when unknown) and the worker processes that are stopped, as (rank, pid, state)."""

    pending_ranks: tuple[int, ...] = ()
    stopped: tuple[tuple[int, int, str], ...] = ()


_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "a zombie (exited)"}


def proc_state(stat_text: str) -> str:
    """The state letter of a /proc/PID/stat line: the field after the command's parentheses
    (which may hold spaces and parentheses itself)."""
    return stat_text[stat_text.rindex(")") + 1 :].split()[0]


def process_state(pid: int) -> str | None:
    """The state letter of a live process ('R', 'S', 'D', 'T', ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return proc_state(f.read())
    except (OSError, ValueError, IndexError):
        return None


def stopped_processes(pids: Iterable[tuple[int, int]]) -> tuple[tuple[int, int, str], ...]:
    """The (rank, pid, state) of the processes among (rank, pid) that cannot run: stopped
    ('T', 't') or exited and not reaped ('Z')."""
    found = []
    for rank, pid in pids:
        state = process_state(pid)
        if state in _STATES:
            found.append((rank, pid, state))
    return tuple(found)


def describe_stall(
    seconds: float,
    timeout_s: float,
    ranks: StalledRanks | None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> str:
    """One sentence for /health and the requests' errors, e.g. "no engine step completed for
    3.1 s (--stall-timeout 3); worker rank 1 (pid 4242) is stopped (SIGSTOP); ranks [0, 1]
    (pipeline stage 0) have not answered the current step"."""
    parts = [f"no engine step completed for {seconds:.1f} s (--stall-timeout {timeout_s:g})"]
    if ranks is not None:
        for rank, pid, state in ranks.stopped:
            parts.append(f"worker rank {rank} (pid {pid}) is {_STATES[state]}")
        if ranks.pending_ranks:
            stages = sorted({r // tensor_parallel_size for r in ranks.pending_ranks})
            where = ""
            if pipeline_parallel_size > 1:
                word = "stage" if len(stages) == 1 else "stages"
                where = f" (pipeline {word} {', '.join(map(str, stages))})"
            parts.append(
                f"ranks {list(ranks.pending_ranks)}{where} have not answered the current step"
            )
    return "; ".join(parts)


def stalled_error(monitor: StallMonitor, executor) -> EngineStalledError:
    """The stall as /health and the requests see it, with what `executor` (None: unknown) can
    tell of the ranks it waits for."""
    ranks, tp, pp = None, 1, 1
    if executor is not None:
        try:
            ranks = executor.stalled_ranks()
            pc = executor.parallel_config
            tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        except Exception:  # what the executor knows is a bonus; the stall stands
            logger.debug("reading the stalled ranks failed", exc_info=True)
    return EngineStalledError(
        describe_stall(monitor.seconds_waiting(), monitor.timeout_s, ranks, tp, pp),
        "check the ranks named (a debugger, the machine's load); raise --stall-timeout if "
        "steps take this long; --restart-on-failure starts the engine again by itself",
        ranks=ranks.pending_ranks if ranks else (),
        stopped=tuple(rank for rank, _, _ in ranks.stopped) if ranks else (),
    )


def restart_delay(restart: int, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Exponential backoff before the `restart`-th restart (1, 2, 3, ...): base, 2 x base, ...,
    at most `cap_s`."""
    return min(cap_s, base_s * 2 ** max(0, restart - 1))
