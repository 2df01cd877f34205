"""The broker's HTTP server around the ASGI app (broker/api/edges.py, issue 16): a
response goes out in one write, a streamed one chunk by chunk with its head at once;
pipelined requests are answered in order; a kept-alive connection left idle is closed
after ``timeout_keep_alive``; the exact-path route lookup finds what the regex scan
finds (broker/api/http_api.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl

from broker.api.common import iso_ms
from broker.api.edges import HttpEdgeConfig, OneWriteCycle, bounded_http_protocol
from broker.api.http_api import PathRoutes, compile_routes, exact_routes
from broker.api.routes import ROUTES
from clients.dev.local_server import free_port

WAIT_S = 10.0


class RecordingTransport:
    """What the cycle writes, one entry per write() call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _cycle(transport: RecordingTransport, method: str = "GET") -> OneWriteCycle:
    scope: Any = {"type": "http", "method": method, "path": "/", "headers": []}
    return OneWriteCycle(
        scope=scope,
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=None,  # type: ignore[arg-type]
        access_logger=None,  # type: ignore[arg-type]
        access_log=False,
        default_headers=[(b"date", b"today")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )


async def test_a_response_with_a_content_length_is_one_write() -> None:
    transport = RecordingTransport()
    cycle = _cycle(transport)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
    assert transport.writes == []  # held for the body
    await cycle.send({"type": "http.response.body", "body": b"{}"})
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\ndate: today\r\ncontent-type: application/json\r\n"
        b"content-length: 2\r\n\r\n{}"
    ]
    assert cycle.response_complete and not transport.closed


async def test_a_streamed_response_sends_its_head_at_once_then_chunks() -> None:
    transport = RecordingTransport()
    cycle = _cycle(transport)
    headers = [(b"content-type", b"text/event-stream")]
    await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\ndate: today\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    ]
    await cycle.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
    assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]
    assert cycle.response_complete


async def test_a_head_response_and_a_closing_one() -> None:
    transport = RecordingTransport()
    cycle = _cycle(transport, method="HEAD")
    headers = [(b"content-length", b"5"), (b"connection", b"close")]
    await cycle.send({"type": "http.response.start", "status": 404, "headers": headers})
    await cycle.send({"type": "http.response.body", "body": b""})
    assert transport.writes == [
        b"HTTP/1.1 404 Not Found\r\ndate: today\r\ncontent-length: 5\r\nconnection: close\r\n\r\n"
    ]
    assert transport.closed


async def test_a_body_longer_than_its_content_length_is_refused() -> None:
    cycle = _cycle(RecordingTransport())
    headers = [(b"content-length", b"1")]
    await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
    with pytest.raises(RuntimeError, match="longer than Content-Length"):
        await cycle.send({"type": "http.response.body", "body": b"ab"})


async def test_header_injection_is_refused() -> None:
    cycle = _cycle(RecordingTransport())
    bad = [(b"location", b"x\r\nset-cookie: a=b")]
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
        await cycle.send({"type": "http.response.start", "status": 307, "headers": bad})


# --- a real server with the broker's protocol ---------------------------------------------


async def _streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/stream: events until the client goes away; anything else: its path, echoed."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: hello\n\n", "more_body": True})
        message = await receive()
        while message["type"] != "http.disconnect":
            message = await receive()
        _streaming_app.disconnects += 1  # type: ignore[attr-defined]
        return
    body = scope["path"].encode()
    headers = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _server(keep_alive_s: float = 30.0) -> AsyncIterator[int]:
    port = free_port()
    _streaming_app.disconnects = 0  # type: ignore[attr-defined]
    config = uvicorn.Config(
        _streaming_app,
        host="127.0.0.1",
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
        proxy_headers=False,
        http=bounded_http_protocol(HttpEdgeConfig(header_timeout_s=5.0)),
        ws="none",
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and not task.done(), "server did not start"
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)


async def _read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    return await asyncio.wait_for(reader.readuntil(marker), WAIT_S)


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with _server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /one HTTP/1.1\r\nhost: x\r\n\r\nGET /two HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        got = b""
        while got.count(b"HTTP/1.1 200") < 2 or not got.endswith(b"/two"):
            chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
            assert chunk, f"closed early: {got!r}"
            got += chunk
        assert got.index(b"/one") < got.index(b"/two")
        writer.close()


async def test_a_stream_reaches_the_client_and_its_disconnect_reaches_the_app() -> None:
    async with _server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await _read_until(reader, b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head
        assert b"data: hello" in await _read_until(reader, b"\n\n")
        writer.close()
        deadline = time.monotonic() + WAIT_S
        while _streaming_app.disconnects == 0:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the app never saw http.disconnect"
            await asyncio.sleep(0.02)


async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout() -> None:
    async with _server(keep_alive_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for path in (b"/a", b"/b"):  # used twice: still open between requests
            writer.write(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
            await _read_until(reader, path)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(1), WAIT_S) == b""
        assert 0.3 < time.monotonic() - started < WAIT_S
        writer.close()


def test_a_kept_alive_connection_in_use_is_not_closed() -> None:
    """Requests every 0.2 s over 1.5 s on a connection with a 0.5 s keep-alive timeout."""

    async def run() -> None:
        async with _server(keep_alive_s=0.5) as port:
            sock = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), WAIT_S)
            reader, writer = await asyncio.open_connection(sock=sock)
            for n in range(8):
                path = b"/r%d" % n
                writer.write(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
                await _read_until(reader, path)
                await asyncio.sleep(0.2)
            writer.close()

    asyncio.run(run())


# --- routing ------------------------------------------------------------------------------


def test_the_exact_path_lookup_finds_what_the_regex_scan_finds() -> None:
    groups = compile_routes(ROUTES)
    exact = exact_routes(groups)
    assert "/api/v1/tasks" in exact and "/healthz" in exact
    literal = [route.path for route in ROUTES if "{" not in route.path]
    assert sorted(exact) == sorted(set(literal))
    for path, group in exact.items():
        assert group is next(g for g in groups if g.pattern.match(path)), path
    # A literal path a parameter's regex would also take is not looked up exactly when
    # that route comes first; /api/v1/tasks/recent is not such a path (ids are digits).
    assert exact["/api/v1/tasks/recent"].handlers["GET"].handler.__name__ == "recent_tasks"


def test_a_literal_path_an_earlier_pattern_takes_is_not_looked_up_exactly() -> None:
    by_id = PathRoutes("/t/{id}", "/t/([a-z]+)")
    recent = PathRoutes("/t/recent", "/t/recent")
    listed = PathRoutes("/t", "/t")
    assert exact_routes([by_id, recent, listed]) == {"/t": listed}
    assert exact_routes([recent, by_id, listed]) == {"/t/recent": recent, "/t": listed}


# --- views --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "epoch_ms",
    [0, 1, 999, 1000, 1001, -1, -999, -1000, -1001, 1_700_000_000_999, 99_999_999_999_999],
)
def test_iso_ms_shows_what_datetime_shows(epoch_ms: int) -> None:
    """iso_ms formats whole seconds once (cached): the same text as datetime's, every time."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=epoch_ms)
    expected = moment.isoformat(timespec="milliseconds")[:-6] + "Z"
    assert iso_ms(epoch_ms) == expected
    assert iso_ms(epoch_ms) == expected  # from the cache
    assert iso_ms(None) is None
