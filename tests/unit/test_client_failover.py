"""The Python clients follow the leader (clients/client/routing.py): not_leader redirects,
retries of retryable errors under one idempotency key, fall-over to the next URL,
and a clear give-up after ``failover_timeout_s``.

Each "broker" is a tiny threaded HTTP server answering from a test-supplied function.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from clients.client import (
    AsyncStewardClient,
    ConflictError,
    ConnectionFailedError,
    FailoverTimeoutError,
    InvalidRequestError,
    StewardClient,
    UnavailableError,
    parse_urls,
)
from tests.support.procs import HOST, free_port


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Answer = tuple[int, dict[str, Any], dict[str, str]]  # status, JSON body, extra headers
Responder = Callable[[Seen], Answer]


def created(seen: Seen) -> Answer:
    if seen.body.startswith(b'{"tasks"'):
        return 200, {"tasks": [{"id": 1, "state": "waiting"}]}, {}
    return 201, {"id": 1, "state": "waiting"}, {}


def unavailable(seen: Seen) -> Answer:
    error = {"code": "unavailable", "message": "taking over", "retryable": True}
    return 503, {"error": error}, {}


class FakeBroker:
    """An HTTP server that records requests and answers with ``respond``."""

    def __init__(self, respond: Responder = created) -> None:
        self.respond = respond
        self.requests: list[Seen] = []
        broker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                seen = Seen(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(length),
                )
                broker.requests.append(seen)
                status, body, headers = broker.respond(seen)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                # No keep-alive: a closed broker must stop answering at once.
                self.send_header("connection", "close")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def keys(self) -> list[str | None]:
        return [r.headers.get("idempotency-key") for r in self.requests]


@pytest.fixture
def brokers() -> Iterator[Callable[..., FakeBroker]]:
    started: list[FakeBroker] = []

    def start(respond: Responder = created) -> FakeBroker:
        broker = FakeBroker(respond)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.close()


def redirect_to(leader: FakeBroker) -> Responder:
    def respond(seen: Seen) -> Answer:
        if seen.method == "GET":
            return 200, {"tasks": [], "next_after": None}, {}
        error = {
            "code": "not_leader",
            "message": "this broker is a follower",
            "leader_url": leader.url,
            "retryable": True,
        }
        return 307, {"error": error}, {"location": leader.url + seen.path}

    return respond


def dead_url() -> str:
    return f"http://{HOST}:{free_port()}"


# --- URLs ------------------------------------------------------------------------------------


def test_parse_urls_accepts_lists_and_comma_separated_strings() -> None:
    assert parse_urls("http://a:1/") == ["http://a:1"]
    assert parse_urls(" http://a:1, http://b:2/ ,") == ["http://a:1", "http://b:2"]
    assert parse_urls(["http://a:1", "http://b:2,http://c:3"]) == [
        "http://a:1",
        "http://b:2",
        "http://c:3",
    ]
    assert parse_urls("http://a:1,http://a:1") == ["http://a:1"]
    empty: str | list[str]
    for empty in ("", " , ", []):
        with pytest.raises(ValueError, match="no broker URL"):
            parse_urls(empty)


# --- writes follow the leader ----------------------------------------------------------------


def test_not_leader_redirect_is_followed_and_remembered(
    brokers: Callable[..., FakeBroker],
) -> None:
    leader = brokers()
    follower = brokers(redirect_to(leader))
    with StewardClient(follower.url, failover_timeout_s=5) as client:
        handle = client.submit("noop", tenant="t")
        assert handle.id == 1
        assert client.leader_url == leader.url
        client.submit("noop")
        client.cancel(1)
    assert [r.method for r in follower.requests] == ["POST"]
    assert [(r.method, r.path) for r in leader.requests] == [
        ("POST", "/api/v1/tasks"),
        ("POST", "/api/v1/tasks"),
        ("POST", "/api/v1/tasks/1/cancel"),
    ]
    # The redirected try carried the key the follower saw: one submission, one key.
    assert follower.keys()[0] == leader.keys()[0]
    assert leader.keys()[0] != leader.keys()[1]


def test_reads_go_to_the_known_leader(brokers: Callable[..., FakeBroker]) -> None:
    leader = brokers()
    follower = brokers(redirect_to(leader))
    with StewardClient([follower.url], failover_timeout_s=5) as client:
        client.tasks()
        assert [r.method for r in follower.requests] == ["GET"]
        client.submit("noop")
        client.tasks()
    assert [r.method for r in leader.requests] == ["POST", "GET"]


def test_retryable_503_is_retried_with_the_same_key(brokers: Callable[..., FakeBroker]) -> None:
    answers = [unavailable, unavailable, created]
    leader = brokers(lambda seen: answers.pop(0)(seen))
    with StewardClient(leader.url, failover_timeout_s=10) as client:
        assert client.submit("noop", idempotency_key="mine").id == 1
    assert leader.keys() == ["mine", "mine", "mine"]


def test_each_submit_call_gets_its_own_generated_key(brokers: Callable[..., FakeBroker]) -> None:
    leader = brokers()
    with StewardClient(leader.url) as client:
        client.submit("noop")
        client.submit("noop")
    first, second = leader.keys()
    assert first and second and first != second


def test_connection_refused_falls_over_to_the_next_url(
    brokers: Callable[..., FakeBroker],
) -> None:
    leader = brokers()
    dead = dead_url()
    with StewardClient(f"{dead},{leader.url}", failover_timeout_s=10) as client:
        started = time.monotonic()
        assert client.submit("noop").id == 1
        client.tasks()  # reads fall over too
        assert time.monotonic() - started < 2.0  # no backoff before an untried URL
    assert [r.method for r in leader.requests] == ["POST", "GET"]


def test_a_read_tries_each_url_once_then_fails(brokers: Callable[..., FakeBroker]) -> None:
    first, second = dead_url(), dead_url()
    with StewardClient([first, second], failover_timeout_s=30) as client:
        started = time.monotonic()
        with pytest.raises(ConnectionFailedError, match="cannot reach"):
            client.cluster()
        assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    ("status", "code", "error_type"),
    [(400, "invalid_request", InvalidRequestError), (409, "slot_busy", ConflictError)],
)
def test_non_retryable_errors_are_raised_at_once(
    brokers: Callable[..., FakeBroker], status: int, code: str, error_type: type[Exception]
) -> None:
    leader = brokers(lambda seen: (status, {"error": {"code": code, "message": "no"}}, {}))
    with StewardClient(leader.url, failover_timeout_s=10) as client, pytest.raises(error_type):
        client.submit("noop")
    assert len(leader.requests) == 1


def test_503_without_retryable_flag_on_a_read_is_not_retried(
    brokers: Callable[..., FakeBroker],
) -> None:
    broker = brokers(unavailable)
    with (
        StewardClient(broker.url, failover_timeout_s=10) as client,
        pytest.raises(UnavailableError),
    ):
        client.health()
    assert len(broker.requests) == 1


def test_gives_up_after_failover_timeout_with_a_clear_error(
    brokers: Callable[..., FakeBroker],
) -> None:
    leader = brokers(unavailable)
    with StewardClient(leader.url, failover_timeout_s=0.8) as client:
        started = time.monotonic()
        with pytest.raises(FailoverTimeoutError) as info:
            client.submit("noop")
        elapsed_s = time.monotonic() - started
    assert 0.8 <= elapsed_s < 3.0
    assert "no broker took the request within" in str(info.value)
    assert "taking over" in str(info.value)
    assert isinstance(info.value.last_error, UnavailableError)
    assert info.value.code == "failover_timeout"
    # Backoff, not a busy loop; one key for every try.
    assert 2 <= len(leader.requests) <= 12
    assert len(set(leader.keys())) == 1


def test_gives_up_when_no_url_answers(brokers: Callable[..., FakeBroker]) -> None:
    url = dead_url()
    client = StewardClient(url, failover_timeout_s=0.5)
    with client, pytest.raises(FailoverTimeoutError, match=f"cannot reach {url}") as info:
        client.submit("noop")
    assert isinstance(info.value.last_error, ConnectionFailedError)


def test_not_leader_without_a_leader_is_retried(brokers: Callable[..., FakeBroker]) -> None:
    leader = brokers()
    calls = 0

    def no_leader_yet(seen: Seen) -> Answer:
        nonlocal calls
        calls += 1
        if calls <= 2:
            error = {"code": "not_leader", "message": "no leader known", "retryable": True}
            return 503, {"error": error}, {}
        return redirect_to(leader)(seen)

    follower = brokers(no_leader_yet)
    with StewardClient(follower.url, failover_timeout_s=10) as client:
        assert client.submit("noop").id == 1
    assert len(follower.requests) == 3
    assert len(set(follower.keys() + leader.keys())) == 1


def test_a_leader_that_dies_is_forgotten(brokers: Callable[..., FakeBroker]) -> None:
    old_leader = brokers()
    new_leader = brokers()
    follower = brokers(redirect_to(old_leader))
    with StewardClient(follower.url, failover_timeout_s=10) as client:
        client.submit("noop")
        assert client.leader_url == old_leader.url
        old_leader.close()
        follower.respond = redirect_to(new_leader)
        client.submit("noop")
        assert client.leader_url == new_leader.url
    assert len(new_leader.requests) == 1


# --- asyncio ---------------------------------------------------------------------------------


async def test_async_client_follows_the_leader_and_retries(
    brokers: Callable[..., FakeBroker],
) -> None:
    answers = [unavailable, created, created]
    leader = brokers(lambda seen: answers.pop(0)(seen))
    follower = brokers(redirect_to(leader))
    async with AsyncStewardClient([dead_url(), follower.url], failover_timeout_s=10) as client:
        handle = await client.submit("noop", idempotency_key="k1")
        assert handle.id == 1
        assert client.leader_url == leader.url
        await client.submit_many([{"type": "noop"}], idempotency_key="k2")
    assert leader.keys() == ["k1", "k1", "k2"]


async def test_async_client_gives_up(brokers: Callable[..., FakeBroker]) -> None:
    leader = brokers(unavailable)
    async with AsyncStewardClient(leader.url, failover_timeout_s=0.5) as client:
        with pytest.raises(FailoverTimeoutError):
            await client.begin()
