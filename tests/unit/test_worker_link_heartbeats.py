"""Heartbeats at scale (docs/DESIGN.md §8): the leader names a longer interval in a
Welcome once its workers would beat more than ``heartbeats_per_s`` times a second, beats
each worker at the interval it named, and judges it by that interval.

Real WorkerLink on an ephemeral port, fake workers over TCP; every wait bounded.
"""

from __future__ import annotations

import asyncio

from broker.core.state import WorkerState
from tests.support.link_broker import BrokerFactory


async def test_welcome_interval_grows_with_the_workers_and_is_kept(
    make_broker: BrokerFactory,
) -> None:
    # 10 beats a second in all: the 2nd worker beats every 200 ms, the 3rd every 300 ms;
    # never longer than a third of the timeout.
    broker = await make_broker(
        heartbeat_interval_ms=100, heartbeat_timeout_ms=1500, heartbeats_per_s=10
    )
    intervals = []
    workers = []
    for n in range(6):
        worker = broker.worker(f"w{n}")
        welcome = await worker.hello(heartbeats=False)
        intervals.append(welcome.heartbeat_interval_ms)
        workers.append(worker)
    assert intervals == [100, 200, 300, 400, 500, 500]

    # Beating at its own (long) interval, the last worker stays connected past several
    # of the base intervals, and the broker beats it about as often, not every 100 ms.
    last = workers[-1]
    last.start_heartbeats(0.5)
    before = last.heartbeats_received
    await asyncio.sleep(1.6)  # what is measured: how often the broker beats in a window
    beaten = last.heartbeats_received - before
    assert 2 <= beaten <= 5, beaten
    assert broker.node.state.workers["w5"].state == WorkerState.CONNECTED
    assert broker.link.liveness.live_session("w5") is not None
    for worker in workers:
        await worker.close()


async def test_a_zero_budget_keeps_the_configured_interval(make_broker: BrokerFactory) -> None:
    broker = await make_broker(heartbeat_interval_ms=100, heartbeats_per_s=0)
    for n in range(3):
        worker = broker.worker(f"w{n}")
        welcome = await worker.hello(heartbeats=False)
        assert welcome.heartbeat_interval_ms == 100
        await worker.close()
