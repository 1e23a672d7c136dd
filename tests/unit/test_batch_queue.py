"""The engine's batches in flight: the executor runs what it is given, the queue decides which
batch's output the step applies."""

from dataclasses import dataclass, field

from llmctl.engine.core.batch_queue import BatchQueue
from llmctl.engine.core.model_runner_output import ModelRunnerOutput
from llmctl.engine.executor.base import Done


@dataclass
class Batch:
    name: str
    total_num_scheduled_tokens: int = 1


@dataclass
class RecordingExecutor:
    submitted: list[str] = field(default_factory=list)

    def check_alive(self):
        pass

    def execute_model(self, batch):
        self.submitted.append(batch.name)
        return Done(ModelRunnerOutput(sampled_token_ids={batch.name: len(self.submitted)}))


def test_one_stage_applies_each_batch_in_its_own_step():
    executor = RecordingExecutor()
    queue = BatchQueue(executor, depth=1)
    batch, output = queue.run(Batch("a"))
    assert batch.name == "a" and output.sampled_token_ids == {"a": 1}
    assert len(queue) == 0


def test_two_stages_keep_two_batches_in_flight_and_drain_in_order():
    executor = RecordingExecutor()
    queue = BatchQueue(executor, depth=2)
    assert queue.run(Batch("a")) is None  # filling: stage 0 may start the next batch
    assert executor.submitted == ["a"]
    batch, output = queue.run(Batch("b"))
    assert batch.name == "a" and output.sampled_token_ids == {"a": 1}
    assert executor.submitted == ["a", "b"]
    # Nothing new scheduled: the pipeline drains, oldest first, and the empty batch is not sent.
    batch, _ = queue.run(Batch("idle", total_num_scheduled_tokens=0))
    assert batch.name == "b"
    assert queue.run(Batch("idle", total_num_scheduled_tokens=0)) is None
    assert executor.submitted == ["a", "b"]
