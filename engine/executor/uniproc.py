"""UniProcExecutor: the single worker runs in the engine's own process."""

from __future__ import annotations

from collections.abc import Callable

from llmctl.engine.executor.base import Done, Executor, run_method
from llmctl.engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self, progress) -> None:
        self.worker = Worker(self.engine_config, rank=0, local_rank=0)
        if self.engine_config.model_config is None:
            return  # a bare worker: the caller runs init_device
        try:
            self.worker.init_device()
            self.worker.load_model(progress)
        except BaseException:
            self.worker.shutdown()  # frees what was loaded (a GPU out of memory: all of it)
            raise

    def collective_rpc_async(
        self, method: str | Callable, args: tuple = (), kwargs: dict | None = None
    ) -> Done:
        return Done([run_method(self.worker, method, args, kwargs or {})])

    def shutdown(self) -> None:
        self.worker.shutdown()
