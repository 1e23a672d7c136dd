"""BatchQueue: the engine's batches in flight through the pipeline.

With pipeline parallelism, stage 0 computes batch k+1 while the last stage computes batch k, so the
engine keeps up to `depth` batches submitted to the executor (depth = the pipeline's stages; 1 for
one stage) and applies the oldest once the queue is full, or as soon as nothing new was scheduled
(the pipeline drains). The executor only runs what it is given; which batch finishes when is
decided here.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmctl.engine.core.model_runner_output import ModelRunnerOutput
    from llmctl.engine.core.scheduler_output import SchedulerOutput
    from llmctl.engine.executor.base import Executor, Future


class BatchQueue:
    def __init__(self, executor: Executor, depth: int, lockstep: bool = False) -> None:
        """`lockstep`: every step runs one forward, a dummy one when nothing was scheduled
        (data-parallel replicas whose MoE layers exchange tokens, engine/dp/lockstep.py)."""
        self.executor = executor
        self.depth = max(1, depth)
        self.lockstep = lockstep
        self._in_flight: deque[tuple[SchedulerOutput, Future]] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def run(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """Submit a batch (an empty one is not sent); return the oldest finished batch with its
        output, or None while the pipeline fills. Raises EngineDeadError once the workers are
        gone, whether or not this step has work."""
        self.executor.check_alive()
        if scheduler_output.total_num_scheduled_tokens:
            future = self.executor.execute_model(scheduler_output)
            self._in_flight.append((scheduler_output, future))
            if len(self._in_flight) < self.depth:
                return None
        elif self.lockstep:
            self.executor.execute_dummy_batch().result()
        if not self._in_flight:
            return None
        oldest, future = self._in_flight.popleft()
        return oldest, future.result()
