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
import urllib.parse
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import httptools
import msgspec
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
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


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, but a response with a Content-Length goes out in
    one write: its head is held until the body's first chunk and written with it. Two
    writes cost a second send() system call and a second TCP segment per response, a
    large part of a small request's cost. A response without a Content-Length (chunked:
    a stream such as server-sent events) has its head written at once."""

    _held_head: bytes = b""

    async def send(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', got {kind!r}.")
            self.response_started = True
            self.waiting_for_100_continue = False
            head = self._head(message["status"], message.get("headers", ()))
            if self.chunked_encoding is False:
                self._held_head = head
            else:
                self.transport.write(head)
            return
        if self.response_complete or kind != "http.response.body":
            raise RuntimeError(f"Unexpected ASGI message {kind!r}.")
        body: bytes = message.get("body", b"")
        more_body: bool = message.get("more_body", False)
        out = self._held_head
        self._held_head = b""
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
        elif self.chunked_encoding:
            if body:
                out += b"%x\r\n%b\r\n" % (len(body), body)
            if not more_body:
                out += b"0\r\n\r\n"
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            out = out + body if out else body
        if out:
            self.transport.write(out)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _head(self, status: int, headers: Any) -> bytes:
        """The status line and headers (as uvicorn writes them; no access log here)."""
        content = [STATUS_LINE[status]]
        has_connection_close = False
        for name, value in (*self.default_headers, *headers):
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [
                token.lower().strip() for token in value.split(b",")
            ]:
                self.keep_alive = False
                has_connection_close = True
            content.append(b"%b: %b\r\n" % (name, value))
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)


_ACTIVE: Final = "active"
_LINGERING: Final = "lingering"
_CLOSED: Final = "closed"
_HEAD: Final = "head"
_BODY: Final = "body"
_IDLE: Final = "idle"  # kept alive between requests (uvicorn's timeout_keep_alive)


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
        # The deadline being enforced (_HEAD, _BODY or _IDLE, and when; None: none while
        # the app answers) and the one
        # timer that checks it. The timer is not moved when the deadline moves later:
        # it fires, sees the deadline ahead, and sleeps again (so requests on a
        # kept-alive connection arm and disarm deadlines without timer calls).
        self._deadline_kind: str | None = None
        self._due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

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
        self._stop_timer()
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
        if self._deadline_kind in (None, _IDLE):  # a later request on a kept-alive connection
            self._arm(_HEAD, self.edge.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(_BODY, self.edge.body_timeout_s)
        # uvicorn's on_headers_complete (no WebSockets here: ws="none"), with the
        # one-write response cycle.
        parser = self.parser
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        parsed_url = httptools.parse_url(self.url)
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed_url.query or b""
        app = self.app
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency
            or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        existing_cycle = self.cycle
        self.cycle = OneWriteCycle(
            scope=scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=False,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        if existing_cycle is None or existing_cycle.response_complete:
            self._start_asgi_task(self.cycle, app)
        else:
            # Pipelined: queued until the earlier response is complete.
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def on_body(self, body: bytes) -> None:
        if self._deadline_kind == _BODY:
            self._due += len(body) / self.edge.body_min_rate_bytes_s
        super().on_body(body)

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive timeout as one of this protocol's deadlines
        # (uvicorn sets and cancels a timer per request for it).
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._deadline_kind is None and self._state == _ACTIVE:
            self._arm(_IDLE, self.timeout_keep_alive)

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
        self._deadline_kind = kind
        self._due = due = self.loop.time() + timeout_s
        if self._timer is None or self._timer_at > due:
            self._stop_timer()
            self._timer_at = due
            self._timer = self.loop.call_at(due, self._on_deadline)

    def _disarm(self) -> None:
        self._deadline_kind = None  # the timer, if any, finds nothing to enforce

    def _stop_timer(self) -> None:
        self._deadline_kind = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_deadline(self) -> None:
        self._timer = None
        kind = self._deadline_kind
        if self._state != _ACTIVE or kind is None:
            return
        if self.loop.time() < self._due:  # moved on since the timer was set
            self._timer_at = self._due
            self._timer = self.loop.call_at(self._due, self._on_deadline)
            return
        if kind == _IDLE:  # kept alive, unused for timeout_keep_alive: close quietly
            self._state_to(_CLOSED)
            self.transport.close()
            return
        if self.flow.read_paused:
            # The server stopped reading (a pipelined request waits, or the app has not
            # taken the body yet): not the client's delay. Count again from now.
            timeout_s = self.edge.header_timeout_s if kind == _HEAD else self.edge.body_timeout_s
            self._arm(kind, timeout_s)
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
        self._stop_timer()
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
        self._timer = self.loop.call_later(self.edge.linger_s, transport.close)


def bounded_http_protocol(edge: HttpEdgeConfig) -> type[BoundedHttpProtocol]:
    """A protocol class for one server (uvicorn's ``http=``): its bounds and counters."""

    class ServerHttpProtocol(BoundedHttpProtocol):
        pass

    ServerHttpProtocol.edge = edge
    ServerHttpProtocol.connections_shared = _Connections()
    return ServerHttpProtocol
