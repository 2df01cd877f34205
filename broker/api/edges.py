"""Bounds at the broker's network edges that its HTTP server does not give by itself.

uvicorn's httptools protocol reads whatever a client sends: httptools keeps a request
line and each header in Python ``bytes`` until it is complete, without any size cap,
and nothing times out a client that sends its headers or body slowly (uvicorn's
``limit_concurrency`` only answers a request whose headers are complete, so it bounds
neither). :class:`BoundedHttpProtocol` is uvicorn's protocol with:

- at most ``max_head_bytes`` of request line and headers handed to the parser: data is
  fed in pieces no longer than what the bound still allows, so the parser never holds
  more; above it the client gets 431 and the connection is closed;
- a header deadline (from the connection's opening, or a later request's first byte)
  and a body deadline (``body_timeout_s``, extended while the body arrives at
  ``body_min_rate_bytes_s``): 408, then close;
- at most ``max_connections`` connections: the next one is answered 503 (retryable)
  at once and closed.

Every refusal is one of the API's JSON error bodies, logged with the peer's address
(rate-limited: :class:`RefusalLog`). After refusing, the connection is half-closed and
what the client still sends is read and dropped for ``linger_s`` (as nginx's lingering
close does), so that the client reads the answer instead of a reset.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import msgspec
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

logger = logging.getLogger(__name__)

_STATUS_LINES: Final = {
    400: b"HTTP/1.1 400 Bad Request\r\n",
    408: b"HTTP/1.1 408 Request Timeout\r\n",
    431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
    503: b"HTTP/1.1 503 Service Unavailable\r\n",
}
# Bytes handed to the parser at once: a request pipelined behind another is charged the
# whole piece it began in (where it begins cannot be told), so pieces stay well below the
# header bound (such a request may have 48 KiB of headers, any other 64 KiB).
_PIECE_BYTES: Final = 16 * 1024


@dataclass(frozen=True)
class HttpEdgeConfig:
    max_head_bytes: int = 64 * 1024  # request line + headers of one request
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Each body byte received moves the body deadline on by 1 / this many seconds: an
    # upload at this rate or faster is never cut off, a client dribbling bytes is.
    body_min_rate_bytes_s: int = 64 * 1024
    max_connections: int = 1024
    # How long a refused connection is still read (and dropped) after the answer.
    linger_s: float = 2.0

    def problem(self) -> str | None:
        """Why this configuration cannot work (None: it can)."""
        if self.max_head_bytes < 1024:
            return "max_head_bytes must be at least 1024"
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.linger_s >= 0):
            return "HTTP timeouts must be > 0"
        if self.body_min_rate_bytes_s < 1:
            return "body_min_rate_bytes_s must be >= 1"
        if self.max_connections < 1:
            return "max_connections must be >= 1"
        return None


class RefusalLog:
    """Warnings about refused peers, at most ``burst`` lines per ``window_s``: a flood of
    refused connections must not become a flood of log lines. The rest are counted and
    reported in one line when the next window begins."""

    def __init__(self, log: logging.Logger, burst: int = 20, window_s: float = 1.0) -> None:
        self._log = log
        self._burst = burst
        self._window_s = window_s
        self._window_start = time.monotonic()
        self._lines = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= self._window_s:
            if self._suppressed:
                self._log.warning(
                    "%d more refusals were not logged in %.1f s", self._suppressed, self._window_s
                )
            self._window_start = now
            self._lines = 0
            self._suppressed = 0
        if self._lines < self._burst:
            self._lines += 1
            self._log.warning(message, *args)
        else:
            self._suppressed += 1


class _Connections:
    """What the connections of one server share."""

    def __init__(self) -> None:
        self.active = 0  # served, counted against max_connections
        self.lingering = 0  # refused, being drained before the close
        self.refusals = RefusalLog(logger)


def error_response(status: int, code: str, message: str, *, retryable: bool = False) -> bytes:
    """A whole HTTP/1.1 response with the API's error body, closing the connection."""
    detail: dict[str, Any] = {"code": code, "message": message}
    if retryable:
        detail["retryable"] = True
    body = msgspec.json.encode({"error": detail})
    return b"".join(
        [
            _STATUS_LINES[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


_ACTIVE: Final = "active"
_LINGERING: Final = "lingering"
_CLOSED: Final = "closed"
_HEAD: Final = "head"
_BODY: Final = "body"


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of :class:`HttpEdgeConfig`
    (subclassed per server by :func:`bounded_http_protocol`)."""

    edge: ClassVar[HttpEdgeConfig] = HttpEdgeConfig()
    connections_shared: ClassVar[_Connections] = _Connections()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._state = _CLOSED  # until connection_made counts it
        self._in_head = True  # the next bytes belong to a request line or headers
        self._head_bytes = 0  # fed to the parser for the current head (an upper bound)
        self._request_begun = False  # a byte of a request not yet complete was received
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_kind = _HEAD
        self._body_deadline = 0.0

    # --- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        shared = self.connections_shared
        if shared.active >= self.edge.max_connections:
            self._refuse(
                503,
                "too_many_connections",
                f"the broker serves at most {self.edge.max_connections} connections at once; "
                "retry later",
                retryable=True,
            )
            return
        shared.active += 1
        self._state = _ACTIVE
        self._arm(_HEAD, self.edge.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._state_to(_CLOSED)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._state != _ACTIVE:
            return  # refused: dropped while lingering
        view = memoryview(data)
        limit = self.edge.max_head_bytes
        while view and self._state == _ACTIVE and not self.transport.is_closing():
            size = min(limit - self._head_bytes, _PIECE_BYTES) if self._in_head else _PIECE_BYTES
            piece = view[:size]
            view = view[len(piece) :]
            # httptools takes any buffer; uvicorn's signature says bytes.
            super().data_received(piece)  # type: ignore[arg-type]
            if self._in_head and self._state == _ACTIVE:
                # Still in a head: the whole piece counts, even when a request began
                # inside it (its bytes there cannot be more than the piece).
                self._head_bytes += len(piece)
                if self._head_bytes >= limit:
                    self._refuse(
                        431,
                        "headers_too_large",
                        f"the request line and headers exceed {limit} bytes",
                    )

    # --- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._request_begun = True
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(_HEAD, self.edge.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(_BODY, self.edge.body_timeout_s)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_deadline += len(body) / self.edge.body_min_rate_bytes_s
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._request_begun = False
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # The parser refused the bytes (uvicorn would answer in plain text).
        self._refuse(400, "invalid_request", f"malformed HTTP request: {msg}")

    # --- deadlines ----------------------------------------------------------------------

    def _arm(self, kind: str, timeout_s: float) -> None:
        self._disarm()
        self._deadline_kind = kind
        deadline = self.loop.time() + timeout_s
        if kind == _BODY:
            self._body_deadline = deadline
        self._deadline = self.loop.call_at(deadline, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self._state != _ACTIVE:
            return
        kind = self._deadline_kind
        if self.flow.read_paused:
            # The server stopped reading (a pipelined request waits, or the app has not
            # taken the body yet): not the client's delay. Count again from now.
            timeout_s = self.edge.header_timeout_s if kind == _HEAD else self.edge.body_timeout_s
            self._arm(kind, timeout_s)
            return
        if kind == _BODY and self.loop.time() < self._body_deadline:
            self._deadline = self.loop.call_at(self._body_deadline, self._on_deadline)
            return
        if kind == _HEAD and not self._request_begun:
            # Opened and never used: nothing to answer.
            logger.info(
                "closed HTTP connection from %s: no request within %s s",
                self._peer(),
                self.edge.header_timeout_s,
            )
            self._state_to(_CLOSED)
            self.transport.close()
            return
        if kind == _HEAD:
            message = f"the request line and headers took over {self.edge.header_timeout_s} s"
        else:
            message = (
                f"the request body arrived too slowly (over {self.edge.body_timeout_s} s, "
                f"below {self.edge.body_min_rate_bytes_s} bytes/s)"
            )
        self._refuse(408, "request_timeout", message)

    # --- refusing -----------------------------------------------------------------------

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "unknown peer"

    def _state_to(self, state: str) -> None:
        shared = self.connections_shared
        if self._state == _ACTIVE:
            shared.active -= 1
        elif self._state == _LINGERING:
            shared.lingering -= 1
        if state == _LINGERING:
            shared.lingering += 1
        elif state == _ACTIVE:
            shared.active += 1
        self._state = state

    def _refuse(self, status: int, code: str, message: str, *, retryable: bool = False) -> None:
        """Answer ``status`` with a JSON error (when the connection owes no other answer
        first), log it with the peer, and close after lingering."""
        self._disarm()
        self._unset_keepalive_if_required()
        self.connections_shared.refusals.warning(
            "refused HTTP connection from %s: %d %s", self._peer(), status, message
        )
        transport = self.transport
        if transport.is_closing():
            self._state_to(_CLOSED)
            return
        cycle = self.cycle
        if self._in_head:
            # An earlier request may still be being answered (pipelining): our answer
            # would be taken for its.
            may_answer = cycle is None or cycle.response_complete
        else:
            # The app may have answered this request already.
            may_answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() ends, its answer is dropped
            cycle.message_event.set()
        if may_answer:
            transport.write(error_response(status, code, message, retryable=retryable))
        shared = self.connections_shared
        if shared.lingering >= self.edge.max_connections or not transport.can_write_eof():
            self._state_to(_CLOSED)
            transport.close()
            return
        self._state_to(_LINGERING)
        transport.write_eof()
        self.flow.resume_reading()
        self._deadline = self.loop.call_later(self.edge.linger_s, transport.close)


def bounded_http_protocol(edge: HttpEdgeConfig) -> type[BoundedHttpProtocol]:
    """A protocol class for one server (uvicorn's ``http=``): its bounds and counters."""

    class ServerHttpProtocol(BoundedHttpProtocol):
        pass

    ServerHttpProtocol.edge = edge
    ServerHttpProtocol.connections_shared = _Connections()
    return ServerHttpProtocol
