"""The clients' waiting on the event stream (clients/client/events.py): the server-sent
event parser, and ``wait_many`` / ``iter_finished`` against scripted brokers that end or
break their streams, refuse, or are not there at all.

Each "broker" is a tiny threaded HTTP server sending a scripted chunked event stream.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from clients.client import (
    AsyncStewardClient,
    EventStreamError,
    NotFoundError,
    StewardClient,
    TaskTimeoutError,
    WaitTimeoutError,
)
from clients.client.events import EventWait, ServerSentEvent, SseParser
from tests.support.procs import HOST, free_port

# --- the parser ---------------------------------------------------------------------------

STREAM = (
    b": keep-alive\n\n"
    b'event: task\nid: 3:17\ndata: {"id": 1}\n\n'
    b'event: task\r\ndata: {"id": 2,\r\ndata:  "x": 1}\r\n\r\n'
    b"data: plain\nretry: 5\nunknown: field\n\n"
    b"event: lonely\n\n"
)
EXPECTED = [
    ServerSentEvent("task", '{"id": 1}', "3:17"),
    ServerSentEvent("task", '{"id": 2,\n "x": 1}', "3:17"),  # the id stays (the standard)
    ServerSentEvent("message", "plain", "3:17"),
]


@pytest.mark.parametrize("piece", [1, 2, 7, 1000])
def test_the_parser_takes_bytes_in_any_pieces(piece: int) -> None:
    parser = SseParser()
    events = []
    for start in range(0, len(STREAM), piece):
        events += parser.feed(STREAM[start : start + piece])
    assert events == EXPECTED


def test_the_parser_bounds_lines_and_events() -> None:
    parser = SseParser(max_line_bytes=100)
    assert parser.feed(b"data: " + b"x" * 90 + b"\n") == []
    with pytest.raises(EventStreamError, match="over 100 bytes"):
        parser.feed(b"data: " + b"y" * 20 + b"\n")  # the event's data over the bound
    parser = SseParser(max_line_bytes=100)
    with pytest.raises(EventStreamError, match="over 100 bytes"):
        parser.feed(b"data: " + b"z" * 200)  # no newline yet: not buffered past the bound


def test_an_event_wait_asks_for_what_it_has_not_seen() -> None:
    clock = [0.0]
    wait = EventWait(list(range(1, 2_502)), 100.0, lambda: clock[0])
    query, read_timeout_s = wait.next_stream()
    assert query["tasks"].split(",") == [str(i) for i in range(1, 2_001)]  # bounded
    assert query["wait_s"] == "30.000" and read_timeout_s == 20.0
    record = {"id": 5, "state": "finished"}
    assert wait.on_event(ServerSentEvent("task", json.dumps(record), "1:2")) == record
    assert wait.on_event(ServerSentEvent("task", json.dumps(record), "1:3")) is None  # seen
    assert wait.on_event(ServerSentEvent("other", "{}")) is None
    with pytest.raises(EventStreamError):
        wait.on_event(ServerSentEvent("task", "[1]"))
    assert "5" not in wait.next_stream()[0]["tasks"].split(",")
    clock[0] = 99.5
    assert wait.next_stream()[0]["wait_s"] == "0.500"
    clock[0] = 100.0
    with pytest.raises(WaitTimeoutError) as info:
        wait.next_stream()
    assert isinstance(info.value, TaskTimeoutError)
    assert info.value.finished == {5: record} and len(info.value.task_ids) == 2_500
    assert "2500 of 2501 tasks not final after 100.0 s: 1, 2, 3, 4, 6" in str(info.value)


# --- the clients against scripted brokers ------------------------------------------------

# A script answers one request (its query) by writing to the handler; "end" closes the
# stream cleanly, "break" cuts the connection mid-stream.
Script = Callable[[dict[str, str], "Handler"], None]


def task_event(task_id: int, state: str = "finished") -> bytes:
    record = {"id": task_id, "state": state, "result": task_id * 10}
    return b"event: task\ndata: " + json.dumps(record).encode() + b"\n\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeBroker

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.server.queries.append(query)
        script = self.server.scripts.pop(0) if self.server.scripts else self.server.default
        script(query, self)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def cut(self) -> None:
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    def error(self, status: int, code: str, retryable: bool = False) -> None:
        body = json.dumps({"error": {"code": code, "message": code, "retryable": retryable}})
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


class FakeBroker(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, scripts: list[Script], default: Script) -> None:
        super().__init__((HOST, 0), Handler)
        self.scripts = scripts
        self.default = default
        self.queries: list[dict[str, str]] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}"


def report_all(query: dict[str, str], handler: Handler) -> None:
    """The well-behaved broker: every asked task is final; the stream ends."""
    handler.start_stream()
    for task_id in query["tasks"].split(","):
        handler.chunk(task_event(int(task_id)))
    handler.end()


def report_first_then_break(query: dict[str, str], handler: Handler) -> None:
    handler.start_stream()
    handler.chunk(b": keep-alive\n\n" + task_event(int(query["tasks"].split(",")[0])))
    handler.cut()


def report_first_then_end(query: dict[str, str], handler: Handler) -> None:
    handler.start_stream()
    handler.chunk(task_event(int(query["tasks"].split(",")[0])))
    handler.end()


def busy(query: dict[str, str], handler: Handler) -> None:
    handler.error(503, "unavailable", retryable=True)


@pytest.fixture
def brokers() -> Iterator[list[FakeBroker]]:
    made: list[FakeBroker] = []
    yield made
    for broker in made:
        broker.shutdown()
        broker.server_close()


def broker(brokers: list[FakeBroker], *scripts: Script, default: Script = report_all) -> str:
    made = FakeBroker(list(scripts), default)
    brokers.append(made)
    return made.url


def test_wait_many_reopens_for_the_tasks_not_seen(brokers: list[FakeBroker]) -> None:
    url = broker(brokers, report_first_then_break, busy, report_first_then_end)
    with StewardClient(url, failover_timeout_s=10) as client:
        records = client.wait_many([4, 2, 9, 2], timeout=10)
    assert list(records) == [4, 2, 9] and records[9]["result"] == 90
    asked = [q["tasks"] for q in brokers[0].queries]
    # broke after 4; refused (503, retried); ended after 2; the rest.
    assert asked == ["4,2,9", "2,9", "2,9", "9"]


def test_other_brokers_serve_when_one_is_gone(brokers: list[FakeBroker]) -> None:
    gone = f"http://{HOST}:{free_port()}"
    url = broker(brokers)
    with StewardClient([gone, url], failover_timeout_s=10) as client:
        assert [r["id"] for r in client.iter_finished([3, 1], timeout=10)] == [3, 1]
        assert client.wait_many([]) == {}


def test_an_error_answer_is_raised(brokers: list[FakeBroker]) -> None:
    def missing(query: dict[str, str], handler: Handler) -> None:
        handler.error(404, "not_found")

    with StewardClient(broker(brokers, missing)) as client, pytest.raises(NotFoundError):
        client.wait_many([1])


def test_the_timeout_names_the_tasks_not_final(brokers: list[FakeBroker]) -> None:
    def silent(query: dict[str, str], handler: Handler) -> None:
        handler.start_stream()
        handler.chunk(task_event(1))
        handler.chunk(b": keep-alive\n\n")
        handler.end()  # as the broker does after wait_s

    url = broker(brokers, default=silent)
    with StewardClient(url) as client, pytest.raises(WaitTimeoutError) as info:
        client.wait_many([1, 2, 3], timeout=0.5)
    assert info.value.task_ids == [2, 3] and list(info.value.finished) == [1]


async def test_the_async_client_reopens_too(brokers: list[FakeBroker]) -> None:
    url = broker(brokers, report_first_then_break, busy, report_first_then_end)
    async with AsyncStewardClient(url, failover_timeout_s=10) as client:
        records = await client.wait_many([4, 2, 9], timeout=10)
        assert list(records) == [4, 2, 9]
        seen = [r["id"] async for r in client.iter_finished([7, 8], timeout=10)]
        assert seen == [7, 8]
    assert [q["tasks"] for q in brokers[0].queries] == ["4,2,9", "2,9", "2,9", "9", "7,8"]
