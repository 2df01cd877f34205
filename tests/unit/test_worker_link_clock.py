"""The worker link's one injected monotonic clock drives its heartbeat supervision.

The heartbeat timeout here is a minute of real time; only the test's clock moves past it.
"""

from __future__ import annotations

import asyncio

from broker.core.state import WorkerState
from tests.support.link_broker import WAIT_S, BrokerFactory


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_silence_is_judged_by_the_injected_clock(make_broker: BrokerFactory) -> None:
    clock = Monotonic()
    broker = await make_broker(
        link_clock=clock, heartbeat_interval_ms=50, heartbeat_timeout_ms=60_000
    )
    silent = broker.worker("silent")
    await silent.hello(heartbeats=False)
    await asyncio.sleep(0.3)  # six beats of real time: the clock has not moved
    assert "silent" in broker.link.sessions and not silent.closed_by_peer

    clock.now += 61  # past the timeout: the next beat closes the connection
    await silent.wait_closed_by_peer(wait_s=WAIT_S)
    await broker.until(lambda: "silent" not in broker.link.sessions)
    await asyncio.sleep(0.2)
    # Disconnected just now by this clock: not yet dead.
    assert broker.node.state.workers["silent"].state == WorkerState.CONNECTED

    clock.now += 61  # a minute without a connection: declared dead through the log
    await broker.until(lambda: broker.node.state.workers["silent"].state != WorkerState.CONNECTED)
