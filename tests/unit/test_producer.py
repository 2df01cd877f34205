"""The pipelining producer (clients/client/producer.py, async_producer.py, producing.py):
batching by max_batch and linger, one batch in flight in submit order, futures resolved from
a batch answer (per-task refusals included), a failed batch failing only its own futures,
client-side checks at submit, the buffer bound, flush and close.

The sender's ``_send`` is replaced by a recording fake (no broker), except in the retry test,
which runs the real client against a small HTTP server answering 503 first."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from clients.client import (
    AsyncStewardClient,
    AsyncTaskHandle,
    FailoverTimeoutError,
    InvalidRequestError,
    Producer,
    ProducerClosedError,
    ProducerFullError,
    StewardClient,
    TaskHandle,
    TenantQueueFullError,
    UnavailableError,
)
from clients.client.api_calls import Request
from clients.client.producing import Buffer
from tests.support.procs import HOST

pytestmark = pytest.mark.timeout(60)


class FakeSend:
    """Answers batches as a broker would (ids from 1 up), recording each request; ``fail``
    may raise for a batch instead. Checks that batches never overlap (one in flight)."""

    def __init__(self, fail: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.batches: list[list[dict[str, Any]]] = []
        self.keys: list[str] = []
        self.next_id = 1
        self.fail = fail
        self.in_flight = 0
        self.gate = threading.Event()
        self.gate.set()

    def answer(self, request: Request) -> list[dict[str, Any]]:
        assert request.content is not None and request.headers
        tasks: list[dict[str, Any]] = json.loads(request.content)["tasks"]
        self.batches.append(tasks)
        headers = dict(line.split(": ", 1) for line in request.headers.split("\r\n") if line)
        self.keys.append(headers["Idempotency-Key"])
        if self.fail is not None:
            self.fail(tasks)
        answers: list[dict[str, Any]] = []
        for task in tasks:
            if (task.get("params") or {}).get("refuse"):
                error = {"code": "tenant_queue_full", "message": "tenant 't' is full"}
                answers.append({"error": error})
            else:
                answers.append({"id": self.next_id, "state": "waiting"})
                self.next_id += 1
        return answers

    def __call__(self, request: Request) -> list[dict[str, Any]]:
        assert self.gate.wait(10)
        self.in_flight += 1
        try:
            assert self.in_flight == 1, "two batches in flight"
            time.sleep(0.002)
            return self.answer(request)
        finally:
            self.in_flight -= 1


@pytest.fixture
def client() -> Iterator[StewardClient]:
    with StewardClient(f"http://{HOST}:9", failover_timeout_s=1.0) as steward:
        yield steward


def producer_with(
    client: StewardClient, fake: FakeSend, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> Producer:
    producer = client.producer(**options)
    monkeypatch.setattr(producer._sender, "_send", fake)
    return producer


def test_batches_by_max_batch_in_submit_order(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    with producer_with(client, fake, monkeypatch, linger_ms=10_000, max_batch=10) as p:
        futures = [p.submit("noop", {"n": n}, tenant="t") for n in range(25)]
        p.flush(timeout=10)
        assert all(f.done() for f in futures)
    handles = [f.result(0) for f in futures]
    assert all(isinstance(h, TaskHandle) and h.client is client for h in handles)
    assert [h.id for h in handles] == list(range(1, 26))  # created in submit order
    assert [len(b) for b in fake.batches] == [10, 10, 5]
    assert [t["params"]["n"] for b in fake.batches for t in b] == list(range(25))
    assert fake.batches[0][0] == {"type": "noop", "params": {"n": 0}, "tenant": "t"}
    assert len(set(fake.keys)) == 3  # one idempotency key per batch


def test_linger_sends_a_partial_batch_without_flush(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    with producer_with(client, fake, monkeypatch, linger_ms=50, max_batch=1000) as p:
        started = time.monotonic()
        futures = [p.submit("noop") for _ in range(3)]
        handles = [f.result(timeout=10) for f in futures]
        waited = time.monotonic() - started
    assert [h.id for h in handles] == [1, 2, 3]
    assert [len(b) for b in fake.batches] == [3]
    assert 0.04 <= waited < 5, waited


def test_per_task_refusals_resolve_only_their_futures(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    with producer_with(client, fake, monkeypatch, linger_ms=1, max_batch=100) as p:
        futures = [p.submit("noop", {"refuse": n % 3 == 0}) for n in range(9)]
    for n, future in enumerate(futures):
        if n % 3 == 0:
            error = future.exception(0)
            assert isinstance(error, TenantQueueFullError), error
            assert (error.status, error.code) == (429, "tenant_queue_full")
        else:
            assert isinstance(future.result(0), TaskHandle)


def test_a_failed_batch_fails_its_futures_only(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(tasks: list[dict[str, Any]]) -> None:
        if tasks[0]["params"] == {"doomed": True}:
            raise FailoverTimeoutError(UnavailableError(503, "unavailable", "no leader"), 1.0, 3)

    fake = FakeSend(fail)
    with producer_with(client, fake, monkeypatch, linger_ms=10_000, max_batch=2) as p:
        first = [p.submit("noop", {"doomed": True}) for _ in range(2)]
        second = [p.submit("noop") for _ in range(2)]
    assert all(isinstance(f.exception(0), FailoverTimeoutError) for f in first)
    assert [f.result(0).id for f in second] == [1, 2]


def test_an_unexpected_error_still_resolves_every_future(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(tasks: list[dict[str, Any]]) -> None:
        raise RuntimeError("transport bug")

    with producer_with(client, FakeSend(fail), monkeypatch, linger_ms=1, max_batch=5) as p:
        futures = [p.submit("noop") for _ in range(12)]
    assert all(isinstance(f.exception(0), RuntimeError) for f in futures)


def test_an_unreadable_answer_fails_its_batch(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers: list[Any] = [[{"id": 1}], ["nonsense"], [], [{"id": 4, "state": "waiting"}]]
    with producer_with(client, FakeSend(), monkeypatch, linger_ms=10_000, max_batch=1) as p:
        monkeypatch.setattr(p._sender, "_send", lambda request: answers.pop(0))
        futures = [p.submit("noop") for _ in range(4)]
    for future in futures[:3]:
        error = future.exception(0)
        assert isinstance(error, UnavailableError) and error.code == "bad_answer", error
    assert futures[3].result(0).id == 4


def test_one_task_refused_by_the_broker_does_not_poison_its_batch(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker refuses a whole batch for one task's fields (here: a type it rejects);
    # that future fails, the others go again under a new key, in order.
    def fail(tasks: list[dict[str, Any]]) -> None:
        for index, task in enumerate(tasks):
            if task["type"] == "bad type!":
                message = f"tasks[{index}]: type must match the name pattern"
                raise InvalidRequestError(400, "invalid_request", message)

    fake = FakeSend(fail)
    with producer_with(client, fake, monkeypatch, linger_ms=10_000, max_batch=10) as p:
        futures = [p.submit("bad type!" if n in (2, 5) else "noop") for n in range(8)]
    for n, future in enumerate(futures):
        if n in (2, 5):
            error = future.exception(0)
            assert isinstance(error, InvalidRequestError)
            assert error.message == "type must match the name pattern"
        else:
            assert isinstance(future.result(0), TaskHandle)
    assert [f.result(0).id for n, f in enumerate(futures) if n not in (2, 5)] == list(range(1, 7))
    assert [len(b) for b in fake.batches] == [8, 7, 6]
    assert len(set(fake.keys)) == 3


@pytest.mark.parametrize(
    ("args", "options", "fragment"),
    [
        (("noop", {"x": object()}), {}, "not JSON-serialisable"),
        (("noop",), {"colour": "red"}, "unknown field `colour`"),
        (("noop",), {"max_attempts": "three"}, "Expected `int`"),
        (("",), {}, "type must be a non-empty string"),
        (("noop",), {"tenant": 7}, "Expected `str`"),
    ],
)
def test_invalid_tasks_raise_at_submit(
    client: StewardClient,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[Any, ...],
    options: dict[str, Any],
    fragment: str,
) -> None:
    fake = FakeSend()
    with producer_with(client, fake, monkeypatch, linger_ms=1, max_batch=10) as p:
        good = p.submit("noop")
        with pytest.raises(InvalidRequestError, match=fragment):
            p.submit(*args, **options)
        after = p.submit("noop")
    assert [good.result(0).id, after.result(0).id] == [1, 2]
    assert sum(len(b) for b in fake.batches) == 2


def test_a_full_buffer_blocks_then_raises(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    fake.gate.clear()  # the broker does not answer: nothing leaves the buffer
    p = producer_with(
        client, fake, monkeypatch, linger_ms=0, max_batch=1, max_buffered=2, max_block_s=0.3
    )
    first = p.submit("noop")  # taken by the sender, which then hangs
    deadline = time.monotonic() + 10
    while p._buffer.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    queued = [p.submit("noop") for _ in range(2)]
    started = time.monotonic()
    with pytest.raises(ProducerFullError, match=r"max_block_s=0\.3"):
        p.submit("noop")
    assert 0.25 <= time.monotonic() - started < 5
    fake.gate.set()
    p.close(timeout=10)
    assert [f.result(0).id for f in [first, *queued]] == [1, 2, 3]
    with pytest.raises(ProducerClosedError):
        p.submit("noop")


def test_exit_on_an_exception_still_flushes(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    futures = []
    with (
        pytest.raises(KeyError),
        producer_with(client, fake, monkeypatch, linger_ms=10_000, max_batch=100) as p,
    ):
        futures = [p.submit("noop") for _ in range(5)]
        raise KeyError("the caller's own error")
    assert [f.result(0).id for f in futures] == [1, 2, 3, 4, 5]


def test_a_future_cancelled_before_sending_creates_nothing(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    with producer_with(client, fake, monkeypatch, linger_ms=10_000, max_batch=100) as p:
        futures = [p.submit("noop", {"n": n}) for n in range(4)]
        assert futures[1].cancel()
        futures[3].set_exception(KeyError("resolved by the caller"))  # not sent either
        after = p.submit("noop", {"n": 4})
    assert [t["params"]["n"] for b in fake.batches for t in b] == [0, 2, 4]
    assert [f.result(0).id for f in (futures[0], futures[2], after)] == [1, 2, 3]


def test_batches_stay_under_the_request_size_limit(
    client: StewardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSend()
    big = "x" * 60_000  # 100 tasks of ~60 KB: over the 4 MiB a batch may hold
    with producer_with(client, fake, monkeypatch, linger_ms=10_000, max_batch=1000) as p:
        futures = [p.submit("noop", {"n": n, "pad": big}) for n in range(100)]
    assert [f.result(0).id for f in futures] == list(range(1, 101))
    assert len(fake.batches) == 2
    assert all(len(json.dumps(b)) <= 4 * 1024 * 1024 for b in fake.batches)


def test_buffer_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        Buffer(5, 0, 10)
    with pytest.raises(ValueError, match="max_batch"):
        Buffer(5, 10_001, 20_000)
    with pytest.raises(ValueError, match="max_buffered"):
        Buffer(5, 100, 10)
    with pytest.raises(ValueError, match="linger_ms"):
        Buffer(-1, 1, 10)


def test_async_producer_batches_and_flushes(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        fake = FakeSend()

        async def send(request: Request) -> list[dict[str, Any]]:
            await asyncio.sleep(0.002)
            return fake.answer(request)

        async with AsyncStewardClient(f"http://{HOST}:9") as steward:
            producer = steward.producer(linger_ms=10_000, max_batch=4)
            monkeypatch.setattr(producer._sender, "_send", send)
            async with producer as p:
                futures = [await p.submit("noop", {"n": n}, tenant="t") for n in range(10)]
                cancelled = await p.submit("noop", {"n": -1})
                cancelled.cancel()
                await asyncio.wait_for(p.flush(), 10)
                assert all(f.done() for f in futures)
                last = await p.submit("noop", {"n": 10})
            handles = [f.result() for f in [*futures, last]]
            assert all(isinstance(h, AsyncTaskHandle) and h.client is steward for h in handles)
            assert [h.id for h in handles] == list(range(1, 12))
            assert [len(b) for b in fake.batches] == [4, 4, 2, 1]
            with pytest.raises(ProducerClosedError):
                await p.submit("noop")

    asyncio.run(main())


class _RetryingBroker:
    """Answers the first two batch requests 503 (retryable), then creates the tasks."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        broker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                broker.requests.append((self.headers["idempotency-key"], body))
                if len(broker.requests) <= 2:
                    status = 503
                    error = {"code": "unavailable", "message": "taking over", "retryable": True}
                    answer: dict[str, Any] = {"error": error}
                else:
                    status = 200
                    tasks = json.loads(body)["tasks"]
                    answer = {
                        "tasks": [{"id": i + 1, "state": "waiting"} for i in range(len(tasks))]
                    }
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_retried_batch_is_resent_unchanged_under_its_key() -> None:
    broker = _RetryingBroker()
    try:
        with (
            StewardClient(broker.url, failover_timeout_s=20) as steward,
            steward.producer(linger_ms=10_000, max_batch=100) as p,
        ):
            futures = [p.submit("noop", {"n": n}) for n in range(5)]
        assert [f.result(0).id for f in futures] == [1, 2, 3, 4, 5]
        assert len(broker.requests) == 3
        assert len(set(broker.requests)) == 1  # same key, same bytes on every try
    finally:
        broker.close()
