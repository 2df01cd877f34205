"""The clients' own HTTP/1.1 transport (clients/client/transport.py, async_transport.py):
the answer parser, kept-alive connections (reused, a stale one retried once, ``Connection:
close`` honoured), the request bytes (query encoding, binary bodies, the bearer token),
timeouts, and the streamed GET.

The "brokers" are raw TCP servers in threads, so each test says byte by byte what the
server does with each connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clients.client import (
    AsyncStewardClient,
    ConnectionFailedError,
    InvalidRequestError,
    NotFoundError,
    StewardClient,
    UnavailableError,
)
from clients.client.async_transport import MAX_IDLE_PER_BROKER
from clients.client.events import StreamBrokenError
from clients.client.sync_client import _stream_lines
from clients.client.transport import (
    MAX_HEAD_BYTES,
    ResponseParser,
    StaleConnectionError,
    TransportError,
    request_target,
)
from tests.support.procs import HOST

WAIT_S = 10.0
Handler = Callable[[int, socket.socket], None]  # connection number (from 0), its socket


class RawServer:
    """A TCP server: each accepted connection is served by ``handle`` in a thread."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(0.05)
        self.url = f"http://{HOST}:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body), as read_request saw
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            number = self.connections
            self.connections += 1
            threading.Thread(target=self._serve, args=(number, sock), daemon=True).start()

    def _serve(self, number: int, sock: socket.socket) -> None:
        sock.settimeout(WAIT_S)
        with sock, contextlib.suppress(OSError):
            self.handle(number, sock)

    def read_request(self, sock: socket.socket) -> bytes | None:
        """One request's head (None: the client closed the connection)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += sock.recv(65536)
        self.requests.append((head, body))
        return head

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        self.listener.close()


def answer(body: object = None, status: str = "200 OK", extra: bytes = b"") -> bytes:
    data = json.dumps({"id": 1, "state": "waiting"} if body is None else body).encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n".encode()
        + extra
        + b"\r\n"
        + data
    )


@pytest.fixture
def servers() -> Iterator[Callable[[Handler], RawServer]]:
    started: list[RawServer] = []

    def start(handle: Handler) -> RawServer:
        server = RawServer(handle)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def keep_alive_server(start: Callable[[Handler], RawServer]) -> RawServer:
    """Answers every request on a connection until the client closes it."""

    def handle(_: int, sock: socket.socket) -> None:
        while server.read_request(sock) is not None:
            sock.sendall(answer())

    server = start(handle)
    return server


# --- the parser ------------------------------------------------------------------------------


def parse(data: bytes, step: int) -> ResponseParser:
    parser = ResponseParser()
    for i in range(0, len(data), step):
        parser.feed(data[i : i + step])
    return parser


@pytest.mark.parametrize("step", [1, 2, 7, 1 << 20])
def test_parser_reads_length_chunked_and_interim_answers_fed_in_any_pieces(step: int) -> None:
    parser = parse(answer({"x": 1}, extra=b"X-Two: a\r\nx-two: b\r\n"), step)
    assert parser.done and parser.keep_alive
    response = parser.response()
    assert (response.status, response.reason, response.json()) == (200, "OK", {"x": 1})
    assert response.headers["x-two"] == "a, b"

    chunked = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\ntrailer: x\r\n\r\n"
    )
    parser = parse(chunked, step)
    assert parser.done and parser.keep_alive
    assert (parser.status, parser.response().body) == (404, b"hello world")


def test_parser_close_delimited_and_cut_short_answers() -> None:
    parser = parse(b"HTTP/1.0 200 OK\r\n\r\npart one, ", 4)
    parser.feed(b"part two")
    assert not parser.done
    parser.eof()
    assert parser.done and not parser.keep_alive
    assert parser.response().body == b"part one, part two"

    assert not parse(answer(extra=b"Connection: close\r\n"), 100).keep_alive
    with pytest.raises(StaleConnectionError):
        ResponseParser().eof()  # nothing at all: the connection was closed while idle
    cut = parse(answer({"x": "y" * 100})[:-10], 100)
    with pytest.raises(TransportError, match="middle of its answer") as info:
        cut.eof()
    assert not isinstance(info.value, StaleConnectionError)


@pytest.mark.parametrize(
    "data",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD_BYTES + 10),
    ],
)
def test_parser_refuses_malformed_or_oversized_answers(data: bytes) -> None:
    with pytest.raises(TransportError):
        parse(data, 1 << 20)


def test_request_target_encodes_path_and_query_as_httpx_did() -> None:
    assert request_target("/api/v1/tenants/a b", None) == "/api/v1/tenants/a%20b"
    query = {"tenant": "a b&c=d", "limit": 5, "flag": True, "state": "waiting"}
    assert (
        request_target("/api/v1/tasks", query)
        == "/api/v1/tasks?tenant=a%20b%26c%3Dd&limit=5&flag=true&state=waiting"
    )


# --- connections -----------------------------------------------------------------------------


def test_one_kept_alive_connection_carries_every_call_with_the_token(
    servers: Callable[[Handler], RawServer], tmp_path: Path
) -> None:
    server = keep_alive_server(servers)
    artifact = tmp_path / "job.zip"
    artifact.write_bytes(bytes(range(256)) * 4)
    with StewardClient(server.url, token="s3cret") as client:
        for _ in range(5):
            client.health()
        client.tasks(tenant="a b&c", state="waiting")
        with pytest.raises(KeyError):  # the fake answer has no sha256: only the bytes matter
            client.upload_code(artifact)
    assert server.connections == 1
    heads = [head for head, _ in server.requests]
    assert all(b"\r\nauthorization: Bearer s3cret" in head for head in heads)
    assert heads[5].startswith(b"GET /api/v1/tasks?limit=100&state=waiting&tenant=a%20b%26c ")
    assert heads[6].startswith(b"POST /api/v1/code?name=job.zip ")
    assert server.requests[6][1] == artifact.read_bytes()


def test_a_token_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="line breaks"):
        StewardClient("http://127.0.0.1:1", token="a\r\nx-evil: 1")


def test_a_connection_the_server_closed_while_idle_is_replaced_unseen(
    servers: Callable[[Handler], RawServer],
) -> None:
    closed = threading.Semaphore(0)

    def handle(_: int, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(answer())
            sock.close()  # without saying so (an idle timeout)
            closed.release()

    server = servers(handle)
    with StewardClient(server.url) as client:
        for _ in range(3):
            client.submit("noop")
            assert closed.acquire(timeout=WAIT_S)  # closed before the next call
    assert server.connections == 3
    assert len(server.requests) == 3


def test_a_request_lost_on_a_stale_connection_is_resent_once(
    servers: Callable[[Handler], RawServer],
) -> None:
    def handle(number: int, sock: socket.socket) -> None:
        server.read_request(sock)
        sock.sendall(answer())
        if number < 2:
            server.read_request(sock)  # the next request is dropped unanswered
            return
        while server.read_request(sock) is not None:
            sock.sendall(answer())

    server = servers(handle)
    # No failover time: the client's own retries cannot be what saves these calls (and a
    # read is tried once per broker anyway).
    with StewardClient(server.url, failover_timeout_s=0) as client:
        client.health()
        client.task(1)
        client.submit("noop", idempotency_key="k1")
    heads = [head.lower() for head, _ in server.requests]
    assert [head.split(b" ")[0] for head in heads] == [b"get", b"get", b"get", b"post", b"post"]
    assert [head.split(b"idempotency-key: ")[-1][:2] for head in heads[3:]] == [b"k1", b"k1"]
    assert server.connections == 3


def test_an_interrupted_call_leaves_no_answer_behind_for_the_next(
    servers: Callable[[Handler], RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    def handle(_: int, sock: socket.socket) -> None:
        while server.read_request(sock) is not None:
            data = answer()
            sock.sendall(data[:-5])
            time.sleep(0.1)
            sock.sendall(data[-5:])

    class Interrupt(BaseException):
        pass

    feed = ResponseParser.feed

    def interrupted(self: ResponseParser, data: bytes) -> None:
        monkeypatch.setattr(ResponseParser, "feed", feed)
        raise Interrupt  # as a KeyboardInterrupt would, with the answer half read

    server = servers(handle)
    with StewardClient(server.url) as client:
        client.health()
        monkeypatch.setattr(ResponseParser, "feed", interrupted)
        with pytest.raises(Interrupt):
            client.health()
        assert client.health() == {"id": 1, "state": "waiting"}
    assert server.connections == 2


def test_a_new_connection_closed_unanswered_is_a_connection_error(
    servers: Callable[[Handler], RawServer],
) -> None:
    def handle(_: int, sock: socket.socket) -> None:
        server.read_request(sock)

    server = servers(handle)
    with StewardClient(server.url) as client, pytest.raises(ConnectionFailedError):
        client.health()
    assert server.connections == 1  # a read tries each broker once


def test_a_reset_connection_is_a_connection_error(
    servers: Callable[[Handler], RawServer],
) -> None:
    def handle(_: int, sock: socket.socket) -> None:
        server.read_request(sock)
        # Linger 0: close() sends a reset instead of a FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    server = servers(handle)
    with StewardClient(server.url) as client, pytest.raises(ConnectionFailedError):
        client.health()


def test_connection_close_answers_and_non_json_errors(
    servers: Callable[[Handler], RawServer],
) -> None:
    def handle(number: int, sock: socket.socket) -> None:
        server.read_request(sock)
        if number == 0:
            sock.sendall(answer(extra=b"Connection: close\r\n"))
            # Stays open: the client must not send the next request here.
            server.read_request(sock)
        elif number == 1:
            sock.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 7\r\n\r\nno road")
        else:
            error = {"error": {"code": "not_found", "message": "no task 7"}}
            sock.sendall(answer(error, "404 Not Found"))

    server = servers(handle)
    with StewardClient(server.url) as client:
        client.health()
        with pytest.raises(UnavailableError, match="no road"):
            client.health()
        with pytest.raises(NotFoundError, match="no task 7"):
            client.task(7)
    assert server.connections == 3


def test_a_request_timeout_is_a_connection_error(servers: Callable[[Handler], RawServer]) -> None:
    def handle(_: int, sock: socket.socket) -> None:
        server.read_request(sock)
        time.sleep(2)

    server = servers(handle)
    started = time.monotonic()
    with (
        StewardClient(server.url, timeout_s=0.3) as client,
        pytest.raises(ConnectionFailedError, match="timed out"),
    ):
        client.health()
    assert time.monotonic() - started < 1.5


def test_a_long_poll_may_take_its_wait_longer_than_the_timeout(
    servers: Callable[[Handler], RawServer],
) -> None:
    def handle(_: int, sock: socket.socket) -> None:
        while server.read_request(sock) is not None:
            time.sleep(0.6)  # the broker holds a long poll until the task ends or wait_s
            sock.sendall(answer({"id": 1, "state": "finished"}))

    server = servers(handle)
    with StewardClient(server.url, timeout_s=0.4) as client:
        assert client.task(1, wait_s=0.5)["state"] == "finished"
        with pytest.raises(ConnectionFailedError, match="timed out"):
            client.task(1)
    assert server.requests[0][0].startswith(b"GET /api/v1/tasks/1?wait_s=0.500 ")


def test_a_bad_url_is_refused_at_once() -> None:
    with StewardClient("ftp://127.0.0.1:1") as client, pytest.raises(ConnectionFailedError):
        client.submit("noop")


def test_a_large_chunked_answer(servers: Callable[[Handler], RawServer]) -> None:
    tasks = [{"id": i, "state": "waiting", "type": "x" * 50} for i in range(50_000)]
    data = json.dumps({"tasks": tasks, "next_after": None}).encode()

    def handle(_: int, sock: socket.socket) -> None:
        server.read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(data), 70_000):
            piece = data[i : i + 70_000]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")

    server = servers(handle)
    with StewardClient(server.url) as client:
        assert client.tasks()["tasks"] == tasks


# --- asyncio ---------------------------------------------------------------------------------


async def test_async_client_serves_concurrent_coroutines_on_kept_alive_connections(
    servers: Callable[[Handler], RawServer],
) -> None:
    server = keep_alive_server(servers)
    async with AsyncStewardClient(server.url) as client:
        for _ in range(3):
            answers = await asyncio.wait_for(
                asyncio.gather(*(client.submit("noop") for _ in range(MAX_IDLE_PER_BROKER))),
                WAIT_S,
            )
            assert len(answers) == MAX_IDLE_PER_BROKER
    assert len(server.requests) == 3 * MAX_IDLE_PER_BROKER
    # Later rounds reuse the first round's connections.
    assert server.connections <= MAX_IDLE_PER_BROKER


async def test_async_client_resends_once_on_a_stale_connection_and_times_out(
    servers: Callable[[Handler], RawServer],
) -> None:
    def handle(number: int, sock: socket.socket) -> None:
        server.read_request(sock)
        if number == 0:
            sock.sendall(answer())
            server.read_request(sock)  # dropped unanswered
        elif number == 1:
            sock.sendall(answer())
        else:
            time.sleep(2)

    server = servers(handle)
    async with AsyncStewardClient(server.url, timeout_s=0.3, failover_timeout_s=0) as client:
        await client.cluster()
        await client.submit("noop", idempotency_key="k1")
        with pytest.raises(ConnectionFailedError, match="timed out"):
            await client.cluster()
    assert server.connections == 3


# --- the streamed GET ------------------------------------------------------------------------


def streaming_server(start: Callable[[Handler], RawServer], chunked: bool) -> RawServer:
    """Streams three events, the second one in pieces, with pauses between them."""

    def handle(_: int, sock: socket.socket) -> None:
        head = server.read_request(sock)
        if head is None or not head.startswith(b"GET /api/v1/events?after=5 "):
            sock.sendall(answer({"error": {"code": "bad", "message": "wrong"}}, "400 Bad"))
            return
        framing = b"transfer-encoding: chunked\r\n" if chunked else b"connection: close\r\n"
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + framing)
        sock.sendall(b"\r\n")
        for piece in (b"data: one\n\n", b"data: t", b"wo\r\n\r\n", b"data: three"):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            time.sleep(0.05)
        if chunked:
            sock.sendall(b"0\r\n\r\n")

    server = start(handle)
    return server


# Each line with its end (an SSE parser is fed them as they come).
EXPECTED_LINES = [b"data: one\n", b"\n", b"data: two\n", b"\n", b"data: three\n"]


@pytest.mark.parametrize("chunked", [True, False])
def test_stream_lines_yields_the_body_as_it_comes(
    servers: Callable[[Handler], RawServer], chunked: bool
) -> None:
    server = streaming_server(servers, chunked)
    with StewardClient(server.url) as client:
        stream = _stream_lines(client, "/api/v1/events", {"after": 5}, timeout_s=WAIT_S)
        first = next(stream)
        assert first == b"data: one\n"
        assert [first, *stream] == EXPECTED_LINES
        with pytest.raises(InvalidRequestError, match="wrong"):
            next(_stream_lines(client, "/api/v1/events", {}, timeout_s=WAIT_S))


async def test_async_stream_lines_and_its_read_timeout(
    servers: Callable[[Handler], RawServer],
) -> None:
    server = streaming_server(servers, chunked=True)
    async with AsyncStewardClient(server.url) as client:
        stream = client._stream_lines("/api/v1/events", {"after": 5}, timeout_s=WAIT_S)
        lines = [line async for line in stream]
        assert lines == EXPECTED_LINES
        with pytest.raises(StreamBrokenError, match="no data for"):
            async for _ in client._stream_lines("/api/v1/events", {"after": 5}, timeout_s=0.01):
                pass
