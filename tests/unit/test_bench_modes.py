"""bench_e2e's Steward driver calls the producer exactly as issue 16 specifies it
(``with client.producer(linger_ms=L, max_batch=B) as p: p.submit("noop", tenant=...)``, then
every future's ``result()``), and skips the mode, saying why, on a client without one.

The producer is being built elsewhere; a stand-in client records the calls. The real
Steward modes run against a broker in tests/integration/test_bench_e2e.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_peers.systems import Steward


class FakeProducer:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.futures: list[Future[str]] = []

    def submit(self, type: str, **options: Any) -> Future[str]:
        self.client.calls.append(("submit", type, options))
        future: Future[str] = Future()
        self.futures.append(future)
        return future


class FakeClient:
    """Counts tasks as final once their future resolved (on the producer's exit)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.final = 0

    @contextmanager
    def producer(self, *, linger_ms: float, max_batch: int) -> Iterator[FakeProducer]:
        self.calls.append(("producer", linger_ms, max_batch))
        p = FakeProducer(self)
        yield p
        for i, future in enumerate(p.futures):  # flushed on exit, like Kafka's producer
            future.set_result(f"handle {i}")
        self.final += len(p.futures)

    def cluster(self) -> dict[str, Any]:
        return {"tasks": {"finished": self.final}}


class PlainClient:
    def cluster(self) -> dict[str, Any]:
        return {"tasks": {}}


def driver(client: object) -> Steward:
    steward = Steward.__new__(Steward)  # no broker: only the submission code is under test
    steward.client = client  # type: ignore[assignment]
    steward.linger_ms = 5.0
    return steward


def test_producer_mode_uses_the_specified_signature() -> None:
    client = FakeClient()
    steward = driver(client)
    assert steward.unavailable("producer") is None
    remaining = steward.submit("producer", 7, 3)
    assert client.calls[0] == ("producer", 5.0, 3)
    assert client.calls[1:] == [("submit", "noop", {"tenant": "bench"})] * 7
    assert remaining() == 0


def test_producer_mode_is_skipped_with_a_reason_without_the_api() -> None:
    reason = driver(PlainClient()).unavailable("producer")
    assert reason is not None and "no producer()" in reason
    assert driver(PlainClient()).unavailable("per-call") is None


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError):
        driver(FakeClient()).submit("pipelined", 1, 1)
