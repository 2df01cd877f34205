"""Many workers on one leader (docs/DESIGN.md §8): the leader names a longer heartbeat
interval in a Welcome once its workers would beat more than ``heartbeats_per_s`` times a
second, beats each worker at the interval it named and judges it by that interval; a
connection over the handshake cap waits for a slot instead of being refused at once.

Real WorkerLink on an ephemeral port, fake workers over TCP; every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib

from broker.core import WorkerState
from broker.core import entries as e
from tests.support.link_broker import BrokerFactory
from wire import worker_protocol as p


async def test_welcome_interval_grows_with_the_workers_and_is_kept(
    make_broker: BrokerFactory,
) -> None:
    # 10 beats a second in all: the 2nd worker beats every 200 ms, the 3rd every 300 ms;
    # past a third of the timeout, the timeout grows to three intervals.
    broker = await make_broker(
        heartbeat_interval_ms=100, heartbeat_timeout_ms=1500, heartbeats_per_s=10
    )
    timings = []
    workers = []
    for n in range(6):
        worker = broker.worker(f"w{n}")
        welcome = await worker.hello(heartbeats=False)
        timings.append((welcome.heartbeat_interval_ms, welcome.heartbeat_timeout_ms))
        workers.append(worker)
    assert timings == [(100, 1500), (200, 1500), (300, 1500), (400, 1500), (500, 1500), (600, 1800)]

    # Beating at its own (long) interval, the last worker stays connected past several
    # of the base intervals, and the broker beats it about as often, not every 100 ms.
    last = workers[-1]
    last.start_heartbeats(0.5)
    before = last.heartbeats_received
    await asyncio.sleep(2.0)  # what is measured: how often the broker beats in a window
    beaten = last.heartbeats_received - before
    assert 2 <= beaten <= 5, beaten
    assert broker.node.state.workers["w5"].state == WorkerState.CONNECTED
    assert broker.link.liveness.live_session("w5") is not None
    for worker in workers:
        await worker.close()


async def test_a_connection_is_judged_by_the_timeout_its_welcome_named(
    make_broker: BrokerFactory,
) -> None:
    # 10 beats a second in all and a 600 ms timeout: the 4th worker is told to beat every
    # 400 ms and given 1,200 ms (Nomad's heartbeat TTL grows with its nodes likewise).
    broker = await make_broker(
        heartbeat_interval_ms=100, heartbeat_timeout_ms=600, heartbeats_per_s=10
    )
    workers = [broker.worker(f"w{n}") for n in range(4)]
    for worker in workers[:3]:
        await worker.hello()  # beating every 100 ms
    last = workers[3]
    welcome = await last.hello(heartbeats=False)
    assert (welcome.heartbeat_interval_ms, welcome.heartbeat_timeout_ms) == (400, 1200)

    # Silent past the configured timeout but within its own: still connected.
    await asyncio.sleep(0.9)
    assert not last.closed_by_peer
    assert broker.node.state.workers["w3"].state == WorkerState.CONNECTED
    last.start_heartbeats(0.4)
    await asyncio.sleep(0.5)

    # Gone: declared dead by today's timeout (1,200 ms for four connected workers), not
    # by the configured 600 ms.
    await last.close()
    await asyncio.sleep(0.8)
    assert broker.node.state.workers["w3"].state == WorkerState.DISCONNECTED  # not dead yet
    await broker.until(lambda: broker.node.state.workers["w3"].state == WorkerState.DEAD)
    assert any("1200 ms" in dead.reason for dead in broker.entries(e.WorkerDead))
    for worker in workers[:3]:
        await worker.close()


async def test_a_zero_budget_keeps_the_configured_interval(make_broker: BrokerFactory) -> None:
    broker = await make_broker(heartbeat_interval_ms=100, heartbeats_per_s=0)
    for n in range(3):
        worker = broker.worker(f"w{n}")
        welcome = await worker.hello(heartbeats=False)
        assert welcome.heartbeat_interval_ms == 100
        await worker.close()


async def test_a_connection_over_the_handshake_cap_waits_for_a_slot(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(max_unauthenticated=2, hello_timeout_s=2.0)
    silent = [(await asyncio.open_connection("127.0.0.1", broker.link.port))[1] for _ in range(2)]
    try:
        await broker.until(lambda: broker.link.handshake.unauthenticated == 2)
        worker = broker.worker("queued")
        hello = asyncio.create_task(worker.hello(heartbeats=False))
        await broker.until(lambda: broker.link.handshake.waiting_for_slot == 1)
        silent.pop().close()  # a slot frees: it passes to the waiting worker
        welcome = await hello
        assert isinstance(welcome, p.Welcome)
        assert broker.node.state.workers["queued"].state == WorkerState.CONNECTED
        await worker.close()
    finally:
        for writer in silent:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    # Every slot comes back once the silent connections are gone.
    await broker.until(lambda: broker.link.handshake.unauthenticated == 0)


async def test_a_connection_waits_for_a_slot_only_so_long(make_broker: BrokerFactory) -> None:
    broker = await make_broker(max_unauthenticated=1, hello_timeout_s=0.5)
    # The one handshake slot, held for the whole test (a raw connection held it only until
    # its own hello deadline, which raced with the late one's wait under load).
    assert await broker.link.handshake.acquire(0)
    try:
        worker = broker.worker("late")
        await worker.connect()
        # The late one waited at most its hello timeout for a slot and was refused (a real
        # worker retries after a backoff).
        error = await worker.expect(p.Error, wait_s=5.0)
        assert error.code == "too_many_connections"
        await worker.close()
    finally:
        broker.link.handshake.release()
    assert broker.link.handshake.waiting_for_slot == 0
