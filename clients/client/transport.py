"""The clients' HTTP/1.1 transport, without an HTTP library on the hot path: request bytes
built directly, answers parsed by hand (Content-Length, chunked or close-delimited bodies,
bounded sizes), one kept-alive connection per broker.

The sans-IO pieces (:class:`Origin`, :func:`request_bytes`, :class:`ResponseParser`,
:class:`Response`) are shared with the asyncio transport (:mod:`.async_transport`); the
blocking socket code (:class:`SyncTransport`, :class:`LineStream`) is the sync client's.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Iterator, Mapping
from typing import Any, Final
from urllib.parse import quote, urlsplit

import msgspec

CONNECT_TIMEOUT_S: Final = 5.0  # a dead broker that drops packets must not use up failover
MAX_HEAD_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 1024 * 1024 * 1024  # a tasks list or a log can be large
MAX_LINE_BYTES: Final = 16 * 1024 * 1024  # one line of a streamed body
READ_SIZE: Final = 256 * 1024
_PATH_SAFE: Final = "/!$&'()*+,;=:@%"  # httpx leaves these (and existing %XX) as they are
_QUERY_SAFE: Final = "!$'()*,;:@/"
_decode = msgspec.json.Decoder().decode


class TransportError(Exception):
    """No usable answer: cannot connect, connection lost, timed out, malformed answer."""


class InvalidURLError(TransportError):
    """A base URL that cannot be used (scheme, host or port); retrying does not help."""


class StaleConnectionError(TransportError):
    """A kept-alive connection ended before the first byte of the answer: the server
    closed it while idle, so the request was not taken and may be sent again."""


class Response:
    """An answer: status, reason, headers (names lower-cased) and the whole body."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not JSON."""
        return _decode(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"Response({self.status} {self.reason})"


class Origin:
    """Where a base URL's requests go, and the parts of their bytes that never change."""

    __slots__ = ("host", "host_header", "port", "prefix", "tls")

    def __init__(self, base: str) -> None:
        try:
            parts = urlsplit(base)
            port = parts.port
        except ValueError as exc:
            raise InvalidURLError(f"invalid URL {base!r}: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise InvalidURLError(f"unsupported URL scheme in {base!r} (http:// or https://)")
        if not parts.hostname:
            raise InvalidURLError(f"no host in URL {base!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.tls else 80)
        self.host_header = parts.netloc.rpartition("@")[2]
        self.prefix = parts.path.rstrip("/")


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def request_target(path: str, query: Mapping[str, Any] | None) -> str:
    """The request target of ``path`` with ``query`` encoded (as httpx did)."""
    target = quote(path, safe=_PATH_SAFE)
    if query:
        target += "?" + "&".join(
            f"{quote(str(k), safe=_QUERY_SAFE)}={quote(_query_value(v), safe=_QUERY_SAFE)}"
            for k, v in query.items()
        )
    return target


def request_bytes(
    method: str, origin: Origin, target: str, body: bytes | None, headers: str
) -> bytes:
    """A whole request; ``headers``: the extra header lines, each ending in CRLF."""
    if body is None:
        if method == "GET":
            return (
                f"{method} {origin.prefix}{target} HTTP/1.1\r\n"
                f"Host: {origin.host_header}\r\n{headers}\r\n"
            ).encode()
        body = b""
    head = (
        f"{method} {origin.prefix}{target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
        f"{headers}Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def header_value(value: str, what: str) -> str:
    """``value`` checked for use in a header line (no line breaks: no header injection)."""
    if "\r" in value or "\n" in value:
        raise ValueError(f"{what} must not contain line breaks")
    return value


_HEAD, _LENGTH, _CHUNKED, _CLOSE, _DONE = range(5)


class ResponseParser:
    """Parses one answer from the bytes fed to it (sans-IO). Once the head is in,
    ``status``/``reason``/``headers`` are set; body pieces collect in ``parts`` (a
    streaming reader takes them as they come); ``done`` once the answer is complete.
    ``keep_alive``: whether the connection may carry the next request."""

    def __init__(self, head_only: bool = False) -> None:
        self.head_only = head_only  # a HEAD request's answer has no body
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.parts: list[bytes] = []
        self.received = 0  # bytes fed so far (none: the connection may have been stale)
        self._state = _HEAD
        self._buffer = bytearray()
        self._remaining = 0  # of the Content-Length body, or of the current chunk
        self._chunk_end = False  # the CRLF after a chunk's data is due
        self._trailers = False
        self._body_size = 0

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def has_head(self) -> bool:
        return self._state != _HEAD

    def response(self) -> Response:
        body = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        return Response(self.status, self.reason, self.headers, body)

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self._state == _HEAD:
            self._buffer += data
            data = self._head()
            if not data:
                return
        if self._state == _LENGTH:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:  # more than announced: do not reuse
                    self.keep_alive = False
                    data = data[: self._remaining]
                self._state = _DONE
            self._remaining -= len(data)
            self._add(data)
        elif self._state == _CLOSE:
            self._add(data)
        elif self._state == _CHUNKED:
            self._buffer += data
            self._chunks()
        elif data:
            self.keep_alive = False  # bytes after the answer: the connection is confused

    def eof(self) -> None:
        """The server closed the connection: the end of a close-delimited body, else an
        answer cut short."""
        if self._state == _CLOSE:
            self._state = _DONE
            return
        if self._state == _DONE:
            return
        if self.received == 0:
            raise StaleConnectionError("the server closed the connection")
        raise TransportError("the server closed the connection in the middle of its answer")

    def _head(self) -> bytes:
        """Parse the head once it is in; the body bytes that came with it."""
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise TransportError(f"answer head over {MAX_HEAD_BYTES} bytes")
                return b""
            if end > MAX_HEAD_BYTES:
                raise TransportError(f"answer head over {MAX_HEAD_BYTES} bytes")
            head = bytes(self._buffer[:end])
            rest = bytes(self._buffer[end + 4 :])
            self._buffer.clear()
            self._parse_head(head)
            if not 100 <= self.status < 200:
                return rest
            self._buffer += rest  # an interim answer (100 Continue): the real one follows
            self.headers = {}

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        version = status_line[0]
        if not version.startswith("HTTP/1.") or len(status_line) < 2:
            raise TransportError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        try:
            self.status = int(status_line[1])
        except ValueError:
            raise TransportError(f"bad status line: {lines[0][:80]!r}") from None
        self.reason = status_line[2] if len(status_line) > 2 else ""
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise TransportError(f"bad header line: {line[:80]!r}")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection and (
            version == "HTTP/1.1" or "keep-alive" in connection
        )
        if 100 <= self.status < 200:
            return
        self._framing(headers)

    def _framing(self, headers: dict[str, str]) -> None:
        if self.head_only or self.status in (204, 304):
            self._state = _DONE
        elif "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower().rstrip().endswith("chunked"):
                self._state = _CHUNKED
            else:
                self._state = _CLOSE
                self.keep_alive = False
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise TransportError("bad Content-Length in the answer") from None
            if not 0 <= length <= MAX_BODY_BYTES:
                raise TransportError(f"answer body of {length} bytes (at most {MAX_BODY_BYTES})")
            self._remaining = length
            self._state = _LENGTH if length else _DONE
        else:
            self._state = _CLOSE
            self.keep_alive = False

    def _add(self, data: bytes) -> None:
        if data:
            self._body_size += len(data)
            if self._body_size > MAX_BODY_BYTES:
                raise TransportError(f"answer body over {MAX_BODY_BYTES} bytes")
            self.parts.append(data)

    def _chunks(self) -> None:
        buffer = self._buffer
        pos = 0
        while self._state == _CHUNKED:
            if self._remaining:
                take = min(self._remaining, len(buffer) - pos)
                if not take:
                    break
                self._add(bytes(buffer[pos : pos + take]))
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                self._chunk_end = True
            if self._chunk_end:
                if len(buffer) - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise TransportError("bad chunked body in the answer")
                pos += 2
                self._chunk_end = False
            newline = buffer.find(b"\r\n", pos)
            if newline < 0:
                if len(buffer) - pos > 4096:
                    raise TransportError("bad chunked body in the answer (size line)")
                break
            line = bytes(buffer[pos:newline])
            pos = newline + 2
            if self._trailers:
                if not line:
                    self._state = _DONE
                continue
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise TransportError(f"bad chunk size {line[:40]!r} in the answer") from None
            if size < 0:
                raise TransportError("bad chunk size in the answer")
            if size == 0:
                self._trailers = True
            self._remaining = size
        del buffer[:pos]
        if self._state == _DONE and buffer:
            self.keep_alive = False


def split_lines(pending: bytes, parts: list[bytes]) -> tuple[list[bytes], bytes]:
    """The complete lines (without their CRLF or LF) in ``pending`` + ``parts``, and
    the rest; ``parts`` is emptied."""
    data = pending + b"".join(parts)
    parts.clear()
    *lines, rest = data.split(b"\n")
    if len(rest) > MAX_LINE_BYTES:
        raise TransportError(f"a streamed line over {MAX_LINE_BYTES} bytes")
    return [line[:-1] if line.endswith(b"\r") else line for line in lines], rest


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class Connection:
    """One blocking socket to one broker, kept alive between requests."""

    def __init__(self, origin: Origin, context: ssl.SSLContext) -> None:
        self.origin = origin
        self.context = context
        self.sock: socket.socket | None = None

    def close(self) -> None:
        if self.sock is not None:
            sock, self.sock = self.sock, None
            sock.close()

    def connect(self, timeout_s: float) -> socket.socket:
        origin = self.origin
        try:
            sock = socket.create_connection(
                (origin.host, origin.port), timeout=min(timeout_s, CONNECT_TIMEOUT_S)
            )
        except OSError as exc:
            raise TransportError(describe(exc)) from exc
        try:
            # Requests go out in one write and answers are awaited: never wait for Nagle.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if origin.tls:
                sock = self.context.wrap_socket(sock, server_hostname=origin.host)
        except OSError as exc:
            sock.close()
            raise TransportError(describe(exc)) from exc
        self.sock = sock
        return sock

    def idle_closed(self) -> bool:
        """Whether the server closed this idle connection (or sent something unasked)."""
        sock = self.sock
        if sock is None:
            return True
        try:
            readable = select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False  # cannot tell; a stale connection is still retried once
        if not readable:
            return False
        sock.setblocking(False)
        try:
            sock.recv(1)
        except (BlockingIOError, ssl.SSLWantReadError):
            return False  # TLS bookkeeping (a session ticket), no data
        except OSError:
            return True
        return True  # an EOF, or bytes nobody asked for: start afresh

    def exchange(
        self, data: bytes, timeout_s: float, head_only: bool = False
    ) -> tuple[Response, bool]:
        """Send a request, read its answer; also whether the connection was reused.
        Raises StaleConnectionError when a reused connection was found closed."""
        sock = self.sock
        reused = sock is not None and not self.idle_closed()
        if not reused:
            self.close()
            sock = self.connect(timeout_s)
        assert sock is not None
        parser = ResponseParser(head_only)
        try:
            sock.settimeout(timeout_s)
            sock.sendall(data)
            while not parser.done:
                chunk = sock.recv(READ_SIZE)
                if chunk:
                    parser.feed(chunk)
                else:
                    parser.eof()
        except StaleConnectionError:
            self.close()
            if reused:
                raise
            raise TransportError("the server closed the connection without answering") from None
        except TransportError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            if reused and parser.received == 0 and not isinstance(exc, TimeoutError):
                raise StaleConnectionError(describe(exc)) from exc
            if isinstance(exc, TimeoutError):
                raise TransportError(f"timed out after {timeout_s:g} s") from exc
            raise TransportError(describe(exc)) from exc
        except BaseException:
            # Interrupted (KeyboardInterrupt) mid-answer: the rest of it must not be read
            # as the next request's answer.
            self.close()
            raise
        if not parser.keep_alive:
            self.close()
        return parser.response(), reused


class SyncTransport:
    """The sync client's connections: one kept alive per broker base URL. Not
    thread-safe (nor is the client): give each thread its own client."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self._connections: dict[str, Connection] = {}

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

    def _connection(self, base: str) -> Connection:
        connection = self._connections.get(base)
        if connection is None:
            connection = self._connections[base] = Connection(Origin(base), self.context)
        return connection

    def request(
        self,
        base: str,
        method: str,
        target: str,
        body: bytes | None,
        headers: str,
        timeout_s: float,
    ) -> Response:
        connection = self._connection(base)
        data = request_bytes(method, connection.origin, target, body, headers)
        try:
            return connection.exchange(data, timeout_s)[0]
        except StaleConnectionError:
            # Closed while idle, the request unread: once more on a new connection.
            return connection.exchange(data, timeout_s)[0]

    def stream(self, base: str, target: str, headers: str, timeout_s: float) -> LineStream:
        """A GET whose body is read as it comes, on a connection of its own."""
        connection = Connection(Origin(base), self.context)
        return LineStream(
            connection, request_bytes("GET", connection.origin, target, None, headers), timeout_s
        )


class LineStream:
    """A streamed GET: :meth:`open` reads the head, :meth:`lines` the body line by line;
    ``timeout_s`` bounds each wait for more bytes."""

    def __init__(self, connection: Connection, data: bytes, timeout_s: float) -> None:
        self.connection = connection
        self.data = data
        self.timeout_s = timeout_s
        self.parser = ResponseParser()

    def close(self) -> None:
        self.connection.close()

    def _read(self) -> None:
        sock = self.connection.sock
        assert sock is not None
        try:
            chunk = sock.recv(READ_SIZE)
        except TimeoutError as exc:
            self.close()
            raise TransportError(f"no data for {self.timeout_s:g} s") from exc
        except OSError as exc:
            self.close()
            raise TransportError(describe(exc)) from exc
        try:
            if chunk:
                self.parser.feed(chunk)
            else:
                self.parser.eof()
        except TransportError:
            self.close()
            raise

    def open(self) -> ResponseParser:
        """Connect, send, and read until the head is in."""
        sock = self.connection.connect(self.timeout_s)
        try:
            sock.settimeout(self.timeout_s)
            sock.sendall(self.data)
        except OSError as exc:
            self.close()
            raise TransportError(describe(exc)) from exc
        while not self.parser.has_head:
            self._read()
        return self.parser

    def rest(self) -> Response:
        """The whole answer (an error answer is read to its end, then reported)."""
        while not self.parser.done:
            self._read()
        self.close()
        return self.parser.response()

    def lines(self) -> Iterator[bytes]:
        pending = b""
        try:
            while True:
                lines, pending = split_lines(pending, self.parser.parts)
                yield from lines
                if self.parser.done:
                    break
                self._read()
            if pending:
                yield pending
        finally:
            self.close()
