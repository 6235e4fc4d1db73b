"""Bounds on the HTTP connections themselves, which uvicorn leaves open-ended: a connection must send
each request's headers within `header_timeout_s` (a silent or slow-header client, such as a
slowloris, is disconnected instead of holding a connection for ever), and at most `max_connections`
are open at once (more get a 503 and are closed). Idle time between requests is uvicorn's keep-alive
timeout.

Two protocols carry the same bounds: uvicorn's httptools one (a C parser, and a response body
written as chunks without a Python state machine: about half the router's CPU per streamed event
is this send path), used when httptools is installed, and its h11 one otherwise. A request either
parser rejects is answered with an OpenAI error body, as every other error is."""

from __future__ import annotations

import asyncio
import functools
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def _error_body(message: str, type_: str) -> bytes:
    """An OpenAI error body, for the answers the protocol writes itself (no app runs for them)."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}).encode()


def _closing_response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        % (status, len(body))
    ) + body


_BUSY = _closing_response(
    b"503 Service Unavailable", _error_body("too many open connections; try again later", "service_unavailable")
)


def _parser_rejection(message: str) -> bytes:
    """A 400 for a request the HTTP parser rejects (uvicorn's own answer is plain text)."""
    return _closing_response(b"400 Bad Request", _error_body(message, "invalid_request_error"))


class _HeaderBounds:
    """The bounds, over either of uvicorn's HTTP protocols (listed after this in a class's bases): both
    keep the request in flight as `cycle`, set once its headers are complete."""

    def __init__(self, *args, header_timeout_s: float, max_connections: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_BUSY)
            transport.close()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if self._header_timer is None and (cycle is None or cycle.response_complete):
            self._await_headers()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not cycle:  # its headers are complete: the request runs
            self._stop_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request headers in %g s", self.header_timeout_s)
            self._before_close()
            self.transport.close()

    def _before_close(self) -> None:
        pass


class BoundedH11Protocol(_HeaderBounds, H11Protocol):
    def _before_close(self) -> None:
        if self.conn.our_state in (h11.IDLE, h11.DONE):
            self.conn.send(h11.ConnectionClosed())

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_parser_rejection(msg))
        self.transport.close()


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed
    HttpToolsProtocol = None

if HttpToolsProtocol is not None:

    class BoundedHttpToolsProtocol(_HeaderBounds, HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            self.transport.write(_parser_rejection(msg))
            self.transport.close()


def bounded_protocol(header_timeout_s: float, max_connections: int, impl: str = "auto"):
    """The protocol class (a factory with uvicorn's constructor signature) for uvicorn.Config(http=...):
    `impl` "httptools", "h11", or "auto" (httptools when installed)."""
    if impl == "auto":
        impl = "h11" if HttpToolsProtocol is None else "httptools"
    cls = BoundedHttpToolsProtocol if impl == "httptools" else BoundedH11Protocol
    return functools.partial(cls, header_timeout_s=header_timeout_s, max_connections=max_connections)
