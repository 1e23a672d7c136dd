"""EngineClient: what the API server, the Ray Serve app and the data-parallel router ask of an
engine, whichever process or node runs it (vLLM's `vllm/engine/protocol.py`).

Implemented by AsyncLLM (client/async_llm.py: the engine in a thread of this process), DPAsyncLLM
(dp/dp_async_llm.py: replicas behind a router) and RemoteReplica (dp/remote_replica.py: a replica
on another node); `LLM` (entrypoints/llm.py) drives one of the first two for offline batches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from llmctl.engine.core.llm_engine import EngineStats, PromptType
from llmctl.engine.errors import EngineDeadError
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Supervision:
    """One replica's supervision, as /metrics shows it."""

    seconds_waiting: float  # with requests and no completed step (0 while idle)
    stalled: bool  # no step completed for --stall-timeout seconds with requests
    restarts: int  # engine restarts (--restart-on-failure)


@runtime_checkable
class EngineClient(Protocol):
    # The served engine's `config` (EngineConfig) and `tokenizer` (None: skip_tokenizer_init).
    engine: Any

    @property
    def is_running(self) -> bool: ...

    def health_error(self) -> EngineDeadError | None:
        """Why no request can be served now (dead, restarting, stalled), or None."""

    def health(self) -> dict:
        """/health's JSON body while the engine serves."""

    def get_stats(self) -> EngineStats: ...

    def replica_states(self) -> list[tuple[int, EngineStats, EngineDeadError | None]]:
        """(data-parallel replica, its stats, why it cannot serve or None), one per replica."""

    def supervision(self) -> list[Supervision]:
        """Each replica's supervision, in the order of replica_states()."""

    def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, on_accepted=None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, the last one finished; closing it aborts it.
        InvalidRequestError before the first output if it is refused; `on_accepted()` once the
        engine took it."""

    def abort(self, request_id: str) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...
