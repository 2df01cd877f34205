"""The asyncio client's HTTP/1.1 transport: asyncio streams, the request bytes and answer
parser of :mod:`.transport`, and a small pool of kept-alive connections per broker so
that coroutines sharing one client each get a connection of their own."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

from clients.client.transport import (
    CONNECT_TIMEOUT_S,
    READ_SIZE,
    Origin,
    Response,
    ResponseParser,
    StaleConnectionError,
    TransportError,
    describe,
    request_bytes,
    split_lines,
)

MAX_IDLE_PER_BROKER = 8  # idle connections kept; more concurrent requests open more


class AsyncConnection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(
        cls, origin: Origin, context: ssl.SSLContext, timeout_s: float
    ) -> AsyncConnection:
        try:
            async with asyncio.timeout(min(timeout_s, CONNECT_TIMEOUT_S)):
                # asyncio turns TCP_NODELAY on by itself.
                reader, writer = await asyncio.open_connection(
                    origin.host,
                    origin.port,
                    ssl=context if origin.tls else None,
                    server_hostname=origin.host if origin.tls else None,
                    limit=READ_SIZE,
                )
        except TimeoutError as exc:
            raise TransportError(f"connect timed out after {CONNECT_TIMEOUT_S:g} s") from exc
        except OSError as exc:
            raise TransportError(describe(exc)) from exc
        return cls(reader, writer)

    def idle_closed(self) -> bool:
        return self.reader.at_eof() or self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()

    async def read(self, parser: ResponseParser) -> None:
        chunk = await self.reader.read(READ_SIZE)
        if chunk:
            parser.feed(chunk)
        else:
            parser.eof()

    async def exchange(self, data: bytes, parser: ResponseParser) -> None:
        self.writer.write(data)
        await self.writer.drain()
        while not parser.done:
            await self.read(parser)


class AsyncTransport:
    """Kept-alive connections per broker base URL; safe for concurrent coroutines."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self._origins: dict[str, Origin] = {}
        self._idle: dict[str, list[AsyncConnection]] = {}

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def origin(self, base: str) -> Origin:
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = Origin(base)
        return origin

    def _take_idle(self, base: str) -> AsyncConnection | None:
        idle = self._idle.get(base)
        while idle:
            connection = idle.pop()
            if not connection.idle_closed():
                return connection
            connection.close()
        return None

    def _put_idle(self, base: str, connection: AsyncConnection) -> None:
        idle = self._idle.setdefault(base, [])
        if len(idle) < MAX_IDLE_PER_BROKER:
            idle.append(connection)
        else:
            connection.close()

    async def request(
        self,
        base: str,
        method: str,
        target: str,
        body: bytes | None,
        headers: str,
        timeout_s: float,
    ) -> Response:
        origin = self.origin(base)
        data = request_bytes(method, origin, target, body, headers)
        for _ in range(2):
            connection = self._take_idle(base)
            reused = connection is not None
            if connection is None:
                connection = await AsyncConnection.open(origin, self.context, timeout_s)
            parser = ResponseParser()
            try:
                async with asyncio.timeout(timeout_s):
                    await connection.exchange(data, parser)
            except StaleConnectionError:
                connection.close()
                if reused:
                    continue  # closed while idle, the request unread: once more
                raise TransportError("the server closed the connection without answering") from None
            except TransportError:
                connection.close()
                raise
            except TimeoutError as exc:
                connection.close()
                raise TransportError(f"timed out after {timeout_s:g} s") from exc
            except OSError as exc:
                connection.close()
                if reused and parser.received == 0:
                    continue
                raise TransportError(describe(exc)) from exc
            except BaseException:
                connection.close()  # cancelled mid-answer: the connection is unusable
                raise
            if parser.keep_alive:
                self._put_idle(base, connection)
            else:
                connection.close()
            return parser.response()
        raise AssertionError("unreachable")  # pragma: no cover

    async def stream(
        self, base: str, target: str, headers: str, timeout_s: float
    ) -> AsyncLineStream:
        """A GET whose body is read as it comes, on a connection of its own; returns
        once the head is in."""
        origin = self.origin(base)
        connection = await AsyncConnection.open(origin, self.context, timeout_s)
        stream = AsyncLineStream(connection, timeout_s)
        try:
            connection.writer.write(request_bytes("GET", origin, target, None, headers))
            while not stream.parser.has_head:
                await stream.read()
        except BaseException:
            connection.close()
            raise
        return stream


class AsyncLineStream:
    """A streamed GET's answer; ``timeout_s`` bounds each wait for more bytes."""

    def __init__(self, connection: AsyncConnection, timeout_s: float) -> None:
        self.connection = connection
        self.timeout_s = timeout_s
        self.parser = ResponseParser()

    def close(self) -> None:
        self.connection.close()

    async def read(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.connection.read(self.parser)
        except TimeoutError as exc:
            self.close()
            raise TransportError(f"no data for {self.timeout_s:g} s") from exc
        except OSError as exc:
            self.close()
            raise TransportError(describe(exc)) from exc
        except BaseException:
            self.close()
            raise

    async def rest(self) -> Response:
        while not self.parser.done:
            await self.read()
        self.close()
        return self.parser.response()

    async def lines(self) -> AsyncIterator[bytes]:
        pending = b""
        try:
            while True:
                lines, pending = split_lines(pending, self.parser.parts)
                for line in lines:
                    yield line
                if self.parser.done:
                    break
                await self.read()
            if pending:
                yield pending
        finally:
            self.close()
