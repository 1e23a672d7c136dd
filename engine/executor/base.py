"""The executor contract: run a method on every worker (`collective_rpc`) and collect results.

Backends: `uni` (the worker in this process), `mp` (one process per rank) and `ray` (one actor per
rank). `Executor.get_class` picks one; Ray is imported only when the Ray backend is used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from llmctl.engine.config import EngineConfig, ParallelConfig
from llmctl.engine.model_runner_output import ModelRunnerOutput
from llmctl.engine.scheduler_output import SchedulerOutput


class Executor(ABC):
    def __init__(self, engine_config: EngineConfig, progress=None) -> None:
        self.engine_config = engine_config
        self.parallel_config = engine_config.parallel_config
        self._init_executor(progress)

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        backend = parallel_config.distributed_executor_backend
        if backend is None:
            backend = "uni" if parallel_config.world_size == 1 else "mp"
        if backend == "uni":
            from llmctl.engine.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        from llmctl.engine.errors import ConfigError

        raise ConfigError(
            f"distributed_executor_backend={backend!r} is not available in this build",
            "use --distributed-executor-backend uni with tensor_parallel_size=1",
        )

    @abstractmethod
    def _init_executor(self, progress) -> None: ...

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method` on every worker; one result per rank, in rank order."""

    @property
    def output_rank(self) -> int:
        """The rank whose execute_model result carries the sampled tokens (last stage, tp 0)."""
        pc = self.parallel_config
        return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def determine_num_available_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:  # noqa: B027 - backends without processes have nothing to stop
        return None
