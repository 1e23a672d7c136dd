"""DPLockstep (engine/dp/lockstep.py) with real threads: every replica steps when one has work,
none when none has; an idle replica is woken when another gets work; a failure releases the
waiting replicas with an error naming the replica that failed and aborts the others; the rank
mesh of replicas sharing one world."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmctl.engine.distributed import ranks
from llmctl.engine.dp.lockstep import DPLockstep
from llmctl.engine.errors import EngineDeadError


class Replica:
    """What DPLockstep asks of an AsyncLLM: wake(), abort_engine(error), stopping."""

    def __init__(self) -> None:
        self.woken = threading.Event()
        self.aborted: list[EngineDeadError] = []
        self.stopping = False

    def wake(self) -> None:
        self.woken.set()

    def abort_engine(self, error: EngineDeadError) -> None:
        self.aborted.append(error)


def attached(size: int) -> tuple[DPLockstep, list[Replica]]:
    lockstep = DPLockstep(size)
    replicas = [Replica() for _ in range(size)]
    for i, replica in enumerate(replicas):
        lockstep.attach(i, replica)
    return lockstep, replicas


def test_every_replica_steps_when_one_is_busy_and_none_when_none_is():
    lockstep, _ = attached(3)
    with ThreadPoolExecutor(3) as pool:
        for busy in ([False, True, False], [False, False, False], [True, True, True]):
            results = list(pool.map(lockstep.sync, range(3), busy))
            assert results == [any(busy)] * 3


def test_a_replica_that_gets_work_wakes_the_idle_ones():
    lockstep, replicas = attached(2)
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lockstep.sync, [0, 1], [False, False])) == [False, False]
        busy = pool.submit(lockstep.sync, 0, True)  # replica 1 idles: it is woken to join
        assert replicas[1].woken.wait(5)
        assert not replicas[0].woken.is_set()
        assert lockstep.sync(1, False) is True
        assert busy.result(5) is True


def test_a_failure_releases_the_waiting_replicas_and_aborts_the_others():
    lockstep, replicas = attached(3)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lockstep.sync, 0, True)
        # waiting or arriving after the failure, it gets the error either way
        lockstep.fail(EngineDeadError("worker rank 0 (pid 7) was killed by SIGKILL"), origin=2)
        with pytest.raises(EngineDeadError) as err:
            waiting.result(5)
    message = err.value.message
    assert message.startswith("data-parallel replica 2 stopped (worker rank 0 (pid 7) was killed")
    assert "the 3 replicas share one expert-parallel world" in message
    assert [len(r.aborted) for r in replicas] == [1, 1, 0]  # not the one that failed
    with pytest.raises(EngineDeadError, match="data-parallel replica 2 stopped"):
        lockstep.sync(1, False)


def test_a_replica_leaving_does_not_count_in_the_round():
    lockstep, _ = attached(2)
    assert lockstep.sync(0, True, leaving=lambda: True) is False
    with ThreadPoolExecutor(2) as pool:  # the next round needs both again
        assert list(pool.map(lockstep.sync, [0, 1], [False, False])) == [False, False]


def test_replicas_sharing_a_world_shift_the_mesh():
    assert ranks.dp_worlds(2, 1, 2) == [[[0, 1]], [[2, 3]]]
    assert ranks.dp_groups(2, 1, 2) == [[0, 2], [1, 3]]
    assert ranks.dp_worlds(1, 2, 2) == [ranks.reshape(2, 2)]
    assert ranks.dp_groups(3, 1, 1) == [[0, 1, 2]]
