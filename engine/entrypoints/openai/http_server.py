"""The HTTP layer under the API: uvicorn with timeouts for clients that stall, and signals that
drain first and then, on the second one, stop at once.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`), but a client that sends half
its headers, or stops reading a stream, holds its connection (and its request's KV blocks) for
ever. `GuardedH11Protocol` closes such a connection after `http_timeout` seconds:
- headers: from the connection's start, or the end of its previous response, to a request;
- writes: while the client reads nothing and the socket's buffer stays full.
A connection that sent part of a request gets a 408 first; an idle one is just closed (as
uvicorn's keep-alive timeout does, usually sooner). The body's own timeout is the app's
(`request_body.read_body`): it answers 408 too.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmctl.engine.entrypoints.openai.errors import error_body

logger = logging.getLogger("llmctl")


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, http_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.http_timeout = http_timeout
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._partial_request = False  # bytes of a request whose headers are not complete yet

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._partial_request = True
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self._header_timer is not None:  # a request began
            self._header_timer.cancel()
            self._header_timer = None
            self._partial_request = False

    def on_response_complete(self) -> None:
        self._arm_header_timer()  # for the next request on this connection
        super().on_response_complete()  # may start a pipelined request: handle_events disarms

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.http_timeout, self._write_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(
            self.http_timeout, self._header_timeout, self.cycle
        )

    def _header_timeout(self, waiting_since) -> None:
        self._header_timer = None
        if self.cycle is not waiting_since or self.transport.is_closing():
            return
        if not self._partial_request:  # an idle connection: close it as keep-alive would
            self.transport.close()
            return
        body = json.dumps(
            error_body(408, f"no complete request headers within {self.http_timeout:g} s")
        ).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _write_timeout(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            logger.warning(
                "closing a connection from %s: it read nothing for %g s",
                self.client and self.client[0],
                self.http_timeout,
            )
            self.transport.abort()  # the request sees a disconnect and is aborted

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None


class HttpServer(uvicorn.Server):
    """uvicorn's server: the first SIGTERM or SIGINT stops accepting and lets in-flight requests
    finish (up to `timeout_graceful_shutdown`); a second one cuts their connections and stops."""

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if not self.should_exit:
            # should_exit first: a second signal handled while this one logs (Python runs a
            # handler between any two bytecodes, this one's too) takes the path below
            super().handle_exit(sig, frame)
            in_flight = len(self.server_state.tasks)  # requests whose response has not ended
            logger.warning("%s received: draining %d in-flight request%s (send it again to stop "
                           "now)", name, in_flight, "" if in_flight == 1 else "s")  # fmt: skip
            return
        if not self.force_exit:
            logger.warning("%s received again: stopping now", name)
        self._captured_signals.append(sig)
        self.force_exit = True
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.abort()


def guarded_protocol(http_timeout: float):
    return functools.partial(GuardedH11Protocol, http_timeout=http_timeout)
