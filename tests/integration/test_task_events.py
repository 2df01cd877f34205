"""Task events on a real broker with a real worker process: the clients' ``wait_many`` and
``iter_finished`` get every task once, in the order they finish, also when the stream's
connection is cut in the middle (the client reopens it for the rest)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clients.client import AsyncStewardClient, NotFoundError, StewardClient, WaitTimeoutError
from tests.support.event_streams import open_feed_async
from tests.support.procs import HOST, BrokerProcess, free_port
from tests.support.worker_procs import TcpProxy, broker_with_worker


@dataclass
class Served:
    url: str
    proxy: TcpProxy  # to the broker's HTTP port


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("events")
    with broker_with_worker(root, "events-worker", ("--task-type", "*=8")) as (broker, _):
        proxy = TcpProxy((HOST, broker.port))
        try:
            yield Served(broker.url, proxy)
        finally:
            proxy.close()


def test_wait_many_and_iter_finished(served: Served) -> None:
    with StewardClient(served.url) as client:
        slow = [client.submit("sleep", {"seconds": s}, tenant="ev") for s in (0.6, 0.3, 0.0)]
        failing = client.submit("fail", {"message": "kaput"}, tenant="ev")
        order = [record["id"] for record in client.iter_finished([*slow, failing], timeout=30)]
        assert order[-2:] == [slow[1].id, slow[0].id]  # the slow ones finish last, in order
        assert sorted(order) == sorted([h.id for h in (*slow, failing)])
        records = client.wait_many([failing, *slow], timeout=30)  # all final: at once
        assert list(records) == [failing.id, *(h.id for h in slow)]
        assert records[failing.id]["state"] == "error"
        assert "kaput" in records[failing.id]["error"]
        assert records[slow[0].id] == {**client.task(slow[0].id)}
        assert records[slow[0].id]["result"] == {"slept": 0.6}
        stuck = client.submit("sleep", {"seconds": 30}, tenant="ev")
        started = time.monotonic()
        with pytest.raises(WaitTimeoutError) as info:
            client.wait_many([slow[0], stuck], timeout=0.5)
        assert time.monotonic() - started < 10
        assert info.value.task_ids == [stuck.id] and list(info.value.finished) == [slow[0].id]
        stuck.cancel()
        with pytest.raises(NotFoundError):
            client.wait_many([stuck.id + 10_000], timeout=5)


def test_a_cut_stream_is_reopened_for_the_rest(served: Served) -> None:
    proxied = f"http://{served.proxy.address}"
    with StewardClient(served.url) as client:
        handles = [
            client.submit("sleep", {"seconds": 0.2 + 0.4 * i}, tenant="ev") for i in range(4)
        ]
    connections = served.proxy.connections
    seen: list[int] = []
    with StewardClient(proxied) as client:
        for record in client.iter_finished(handles, timeout=30):
            seen.append(record["id"])
            if len(seen) == 1:
                served.proxy.cut()  # the stream breaks; the client opens another
    assert seen == [h.id for h in handles]
    assert served.proxy.connections >= connections + 2


async def test_the_async_client(served: Served) -> None:
    async with AsyncStewardClient(served.url) as client:
        handles = [await client.submit("sleep", {"seconds": 0.1}, tenant="ev") for _ in range(5)]
        records = await client.wait_many(handles, timeout=30)
        assert [r["state"] for r in records.values()] == ["finished"] * 5
        seen = [r["id"] async for r in client.iter_finished(handles, timeout=30)]
        assert sorted(seen) == [h.id for h in handles]


def _send_get(port: int, target: str) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=WAIT_STOP_S)
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    chunks = []
    with sock:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


WAIT_STOP_S = 12.0  # the HTTP server's own stop bound is 15 s: answered well before it


def test_a_stopping_broker_answers_long_polls_and_ends_streams_at_once(tmp_path: Path) -> None:
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{free_port()}"),
    )
    broker.start()
    try:
        with StewardClient(broker.url) as client:
            task = client.submit("noop", tenant="stop")  # no worker: it stays queued
        poll = _send_get(broker.port, f"/api/v1/tasks/{task.id}?wait_s=50")
        stream = _send_get(broker.port, f"/api/v1/events?tasks={task.id}&wait_s=50")
        head = stream.recv(65536)  # the stream's head: the broker holds both requests now
        assert head.startswith(b"HTTP/1.1 200"), head
        time.sleep(0.2)
        started = time.monotonic()
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGTERM)
        polled, streamed = _read_to_eof(poll), head + _read_to_eof(stream)
        assert broker.wait_for_exit(WAIT_STOP_S) == 0
        took_s = time.monotonic() - started
    finally:
        broker.kill9()
    assert polled.startswith(b"HTTP/1.1 200"), polled
    answer = json.loads(polled.split(b"\r\n\r\n", 1)[1])
    assert answer["state"] == task.submitted_state == "waiting"  # as it is: not held to wait_s
    assert streamed.endswith(b"0\r\n\r\n"), streamed  # ended cleanly, no event
    assert b"event: task" not in streamed
    assert took_s < WAIT_STOP_S, f"the broker took {took_s:.1f} s to stop"


def test_a_handles_wait_rides_the_event_stream_not_a_long_poll(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StewardClient(served.url) as client:
        handle = client.submit("sleep", {"seconds": 0.3}, tenant="ev")

        def no_polling(*args: object, **kwargs: object) -> dict[str, object]:
            raise AssertionError("wait polled GET /api/v1/tasks/{id}")

        monkeypatch.setattr(client, "task", no_polling)
        assert handle.wait(30)["state"] == "finished"
        assert handle.result(30) == {"slept": 0.3}


async def test_the_async_clients_feed_resumes_after_an_event(served: Served) -> None:
    async with AsyncStewardClient(served.url) as client:
        seen: list[Any] = []
        arrived = asyncio.Event()

        async def read() -> None:
            async for event in client.events(tenant="feed-async", timeout=60):
                seen.append(event)
                arrived.set()

        async def probe() -> int:
            return (await client.submit("noop", tenant="feed-async")).id

        def seen_ids() -> list[int]:
            return [event.task["id"] for event in seen]

        reading = asyncio.ensure_future(read())
        try:
            # The feed is open before the tasks can finish (the probe's event says so).
            probes = await open_feed_async(probe, seen_ids)
            handles = [await client.submit("noop", tenant="feed-async") for _ in range(3)]
            async with asyncio.timeout(30):
                while arrived.clear() or not {h.id for h in handles} <= set(seen_ids()):
                    await arrived.wait()
        finally:
            reading.cancel()
        seen = seen[seen_ids().index(probes[-1]) + 1 :]  # what came after the probe
        assert sorted(event.task["id"] for event in seen) == [h.id for h in handles]
        rest = [
            e async for e in client.events(tenant="feed-async", last_event_id=seen[0].id, timeout=1)
        ]
        assert [(e.id, e.task["id"]) for e in rest] == [(e.id, e.task["id"]) for e in seen[1:]]
