"""DPLockstep: data-parallel replicas that step together (DP attention + EP MoE layers).

With `--data-parallel-size N --enable-expert-parallel` on a mixture-of-experts model, the N
replicas' workers form one torch.distributed world of N x TP ranks (global rank = dp_rank x TP +
tp_rank) and every MoE layer exchanges tokens across the replicas (engine/layers/fused_moe.py).
Each replica still schedules and attends over its own batch, but every forward pass of one
replica's workers meets a forward pass of every other replica's in those collectives: the
replicas must run the same number of forwards, as vLLM's DP engines do.

Each replica's engine thread (core/engine_core.py's loop) calls `sync(index, busy)` once per loop
turn, where `busy` says whether it has unfinished requests. The call returns when every replica has
called it for this round, with whether any of them was busy: then every replica steps, and one with
no work of its own (or none scheduled this step) runs a dummy batch (execute_dummy_batch: one token
through the model, no KV written, nothing sampled); if none was busy, every replica idles. A replica
that gets work while the others idle wakes them, so a request waits for no idle period.

A replica that fails breaks the lockstep for all: the world is shared, so a dead rank would
leave the others blocked in a collective. Every other replica's engine is aborted with an
EngineDeadError naming the replica that failed (its workers are stopped, its requests get the
error), and a replica waiting in `sync` gets the same error at once. A shutdown stops every
replica together (DPAsyncLLM.shutdown), none waiting in `sync` for another.

Start-up: the replicas' executors start at the same time and their workers meet in one
rendezvous; an executor that fails to start aborts the others' (`register_executor`, `fail`), so
none waits for its workers' rendezvous timeout.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from llmctl.engine.errors import ConfigError, EngineDeadError

# A replica waiting for the others looks this often whether it was told to stop.
_POLL_S = 0.5

# The lockstep of each shared world, by its rendezvous port: the replicas' executors register
# with it as they start (weak: a lockstep whose replicas are gone is forgotten).
_LOCKSTEPS: weakref.WeakValueDictionary[int, DPLockstep] = weakref.WeakValueDictionary()
_LOCKSTEPS_LOCK = threading.Lock()


class DPLockstep:
    def __init__(self, size: int, port: int = 0) -> None:
        self.size = size
        self.port = port
        self._cond = threading.Condition()
        self._round = 0
        self._arrived = 0
        self._busy: set[int] = set()  # the replicas busy, in the round being gathered
        self._last = False  # the result of the last completed round
        self.failure: EngineDeadError | None = None
        self._replicas: list = [None] * size  # AsyncLLMs, once serving
        self._executors: list = []  # executors being started or serving
        if port:
            with _LOCKSTEPS_LOCK:
                _LOCKSTEPS[port] = self

    # -- the replicas ------------------------------------------------------------------------------

    def attach(self, index: int, replica) -> None:
        """`replica` (an AsyncLLM) is replica `index`: woken when another gets work, aborted
        when another fails."""
        self._replicas[index] = replica

    def sync(self, index: int, busy: bool, leaving: Callable[[], bool] | None = None) -> bool:
        """Wait until every replica has called sync for this round; True if any was busy (then
        every replica steps). Raises the lockstep's failure once one replica failed; returns
        False at once when `leaving()` (this replica is stopping or failing)."""
        with self._cond:
            self._raise_if_failed()
            round_ = self._round
            wake = busy and not self._last and not self._busy
            if busy:
                self._busy.add(index)
            self._arrived += 1
            if self._arrived == self.size:
                self._last, self._arrived = bool(self._busy), 0
                self._busy = set()
                self._round += 1
                self._cond.notify_all()
                return self._last
        if wake:  # the others may be idling: they come to this round now
            for i, replica in enumerate(self._replicas):
                if i != index and replica is not None:
                    replica.wake()
        with self._cond:
            while self._round == round_:
                self._raise_if_failed()
                if leaving is not None and leaving():
                    self._arrived -= 1  # not in this round after all
                    self._busy.discard(index)
                    return False
                self._cond.wait(_POLL_S)
            return self._last  # the next round needs this replica: it cannot change before

    def fail(self, error: EngineDeadError, origin: int | None = None) -> None:
        """Replica `origin` (None: one at start-up) failed: every other replica is aborted with
        an error naming it, and no round completes again."""
        with self._cond:
            if self.failure is not None:
                return
            who = "a data-parallel replica" if origin is None else f"data-parallel replica {origin}"
            self.failure = EngineDeadError(
                f"{who} stopped ({error.message}); the {self.size} replicas share one "
                "expert-parallel world (--enable-expert-parallel with --data-parallel-size), so "
                "every replica stops",
                error.hint or "restart the server",
            )
            self._cond.notify_all()
        for i, replica in enumerate(self._replicas):
            if i != origin and replica is not None and not replica.stopping:
                replica.abort_engine(self.failure)
        for executor in list(self._executors):
            executor.abort(self.failure)

    def close(self) -> None:
        """Forget this lockstep's world (its replicas are shut down)."""
        if self.port:
            with _LOCKSTEPS_LOCK:
                if _LOCKSTEPS.get(self.port) is self:
                    del _LOCKSTEPS[self.port]

    def _raise_if_failed(self) -> None:
        if self.failure is not None:  # a copy per replica thread: each its own traceback
            raise EngineDeadError(self.failure.message, self.failure.hint)


def register_executor(port: int, executor) -> None:
    """An executor of a replica in the world at `port` starts: a failure of another replica (at
    start-up too) aborts it. Not registered when no DPLockstep owns the port (a tool's own)."""
    with _LOCKSTEPS_LOCK:
        lockstep = _LOCKSTEPS.get(port)
    if lockstep is not None:
        lockstep._executors.append(executor)
        if lockstep.failure is not None:
            executor.abort(lockstep.failure)


def check_engine_args(args, placement) -> None:
    """Refuse, before anything loads, what DP attention with EP MoE layers does not support:
    replicas on other nodes, restarting one replica (the others share its world)."""
    what = (
        f"--enable-expert-parallel with --data-parallel-size {args.data_parallel_size} (the "
        "replicas share their MoE layers' experts)"
    )
    if placement.multi_node or placement.local != placement.size:
        raise ConfigError(
            f"{what} runs every replica on this node; replicas on other nodes "
            "(--data-parallel-size-local) are not supported with it yet",
            "drop --data-parallel-size-local/--data-parallel-address, or drop "
            "--enable-expert-parallel to run independent replicas across nodes",
        )
    if args.restart_on_failure:
        raise ConfigError(
            f"{what}: --restart-on-failure restarts one replica, but the replicas share one "
            "torch.distributed world, so one that fails stops them all",
            "drop --restart-on-failure (a supervisor restarting the server does the same), or "
            "drop --enable-expert-parallel",
        )
