"""RemoteReplica: a data-parallel replica on another node, driven over its connection.

The head's engine-client proxy (engine/dp/join_server.py has the protocol): it has the part of
AsyncLLM's interface that DPAsyncLLM, /health and /metrics use (generate with on_accepted,
health_error, health, get_stats, monitor, stall_error, restarts, shutdown), so the router treats
a remote replica as a local one. A reader thread takes the node's frames and hands each to its
request's asyncio queue (call_soon_threadsafe), as AsyncLLM's engine thread does.

When the connection ends without the head's "shutdown" (the node died, was stopped, or its
network went away), or the node sends nothing for the head's --stall-timeout (a stopped or hung
node: it reports every REPORT_INTERVAL_S, idle or not), the replica is dead: every request in
flight there gets EngineDeadError naming the replica and its host, and /health turns degraded.
Sends happen on the caller's event loop; they are small (a prompt, an abort), and a node that
stops reading is seen as the connection's end by TCP keep-alive (join.tune).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from llmctl.engine.client.protocol import Supervision
from llmctl.engine.config.engine_config import EngineConfig
from llmctl.engine.core.llm_engine import EngineStats, PromptType
from llmctl.engine.dp.join_server import REPORT_INTERVAL_S, JoinedReplica
from llmctl.engine.errors import EngineDeadError, EngineStalledError, InvalidRequestError
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams

logger = logging.getLogger("llmctl")

_ACCEPTED = object()  # queued when the node's engine took the request


@dataclass(frozen=True)
class EngineView:
    """What DPAsyncLLM and the server read from replica 0's engine (its config and tokenizer),
    for a head that runs no replica itself (--data-parallel-size-local 0)."""

    config: EngineConfig
    tokenizer: Any

    @classmethod
    def of(cls, config: EngineConfig) -> EngineView:
        from llmctl.engine.tokenizer.tokenizer import get_tokenizer

        mc = config.model_config
        return cls(config, None if mc.skip_tokenizer_init else get_tokenizer(mc.tokenizer))


class _ReportedMonitor:
    """The node's StallMonitor as of its last report (for /metrics)."""

    def __init__(self, replica: RemoteReplica) -> None:
        self._replica = replica

    def seconds_waiting(self) -> float:
        return float(self._replica.report.get("seconds_waiting", 0.0))

    def stalled(self) -> bool:
        return bool(self._replica.report.get("stalled", False))


class RemoteReplica:
    def __init__(
        self,
        joined: JoinedReplica,
        report: dict,
        head: str,
        engine: EngineView | None = None,
        silence_timeout: float = 0.0,
    ) -> None:
        """`silence_timeout` (the head's --stall-timeout; 0: never): a node that sends nothing
        for so long (it reports every REPORT_INTERVAL_S) is declared stalled."""
        self.rank = joined.rank
        self.host = joined.host
        self.pid = joined.pid
        self.engine = engine  # None unless the head runs no replica (DPAsyncLLM reads replica 0's)
        self.report = report  # the node's last ("ready" or "report")
        self.dead_error: EngineDeadError | None = None
        self.monitor = _ReportedMonitor(self)
        self._head = head
        self._silence_timeout = silence_timeout
        self._silent = False  # the node sent nothing for silence_timeout
        self._conn = joined.conn
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()  # orders registering a stream against the replica's death
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(
            target=self._read, name=f"llmctl-dp{self.rank}-remote", daemon=True
        )
        self._reader.start()

    def describe(self) -> str:
        return f"data-parallel replica {self.rank} on host {self.host} (pid {self.pid})"

    # -- EngineClient (client/protocol.py) -------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.health_error() is None

    def health_error(self) -> EngineDeadError | None:
        """Why the replica cannot serve: its connection ended, or its engine (as reported)."""
        return self.dead_error or self.report.get("error")

    def health(self) -> dict:
        return {**self.report.get("health", {"status": "ok"}), "host": self.host}

    def get_stats(self) -> EngineStats:
        return self.report["stats"]

    def replica_states(self) -> list[tuple[int, EngineStats, EngineDeadError | None]]:
        return [(0, self.get_stats(), self.health_error())]

    def supervision(self) -> list[Supervision]:
        stalled = self.stall_error is not None or self.monitor.stalled()
        return [Supervision(self.monitor.seconds_waiting(), stalled, self.restarts)]

    @property
    def stall_error(self) -> EngineStalledError | None:
        error = self.report.get("error")
        return error if isinstance(error, EngineStalledError) else None

    @property
    def restarts(self) -> int:
        return int(self.report.get("restarts", 0))

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        on_accepted=None,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncLLM.generate: the request's outputs, the last finished; closing the iterator
        early aborts the request on the node."""
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.dead_error is not None:
                raise self.dead_error
            self._streams[request_id] = (stream, asyncio.get_running_loop())
        finished = False
        try:
            self._send(("add", request_id, prompt, params))
            while True:
                item = await stream.get()
                if item is _ACCEPTED:
                    if on_accepted is not None:
                        on_accepted()
                    continue
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        except InvalidRequestError:
            finished = True  # refused: nothing to abort
            raise
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead_error is None:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Tell the node to stop the replica, and wait (up to `timeout`) until it closed the
        connection."""
        self._stopping = True
        self._send(("shutdown", None))
        self._reader.join(timeout)
        self._conn.close()

    # -- internals -------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:
            pass  # the reader sees the connection's end and fails the requests

    def _read(self) -> None:
        silence = self._silence_timeout or None
        while True:
            try:
                if not self._conn.poll(silence):
                    self._silent = True
                    break
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "report":
                self.report = message[1]
            elif kind == "accepted":
                self._deliver(message[1], _ACCEPTED, last=False)
            elif kind == "output":
                output = message[2]
                self._deliver(message[1], output, last=output.finished)
            elif kind == "error":
                self._deliver(message[1], message[2], last=True)
        self._lost()

    def _lost(self) -> None:
        if self._stopping:
            error = EngineDeadError(f"{self.describe()} was shut down")
        elif self._silent:
            error = EngineStalledError(
                f"{self.describe()} sent nothing for {self._silence_timeout:g} s (it reports "
                f"every {REPORT_INTERVAL_S:g} s): its node is stopped, hung or unreachable",
                "see that node; the head closed its connection, so it stops its replica when it "
                "resumes (raise --stall-timeout if its node is only slow)",
            )
            self._conn.close()
        else:
            error = EngineDeadError(
                f"{self.describe()} lost its connection to the head at {self._head}: its "
                "node stopped or died",
                "see that node's log; start it again (llmctl serve ... --headless) and restart "
                "the head to route to it",
            )
        with self._lock:
            self.dead_error = error
            streams = list(self._streams)
        if not self._stopping:
            logger.error("%s", error.message)
        for request_id in streams:
            self._deliver(request_id, error, last=True)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        entry = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if entry is None:
            return
        stream, loop = entry
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass
