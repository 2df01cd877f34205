"""The worker link's one injected monotonic clock drives its heartbeat supervision.

The heartbeat timeout here is a minute of real time; only the test's clock moves past it.
"""

from __future__ import annotations

import asyncio

from broker.core import WorkerState
from tests.support.link_broker import WAIT_S, BrokerFactory, Monotonic
from wire import worker_protocol as p


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
    # Silent past the timeout since its last frame: declared dead through the log, not a
    # second timeout after the close.
    await broker.until(lambda: broker.node.state.workers["silent"].state == WorkerState.DEAD)


async def test_a_worker_that_spoke_just_before_its_connection_dropped_gets_the_timeout(
    make_broker: BrokerFactory,
) -> None:
    clock = Monotonic()
    broker = await make_broker(
        link_clock=clock, heartbeat_interval_ms=50, heartbeat_timeout_ms=60_000
    )
    worker = broker.worker("chatty")
    await worker.hello(heartbeats=False)
    clock.now += 50  # it beats at this clock, then its connection drops
    worker.start_heartbeats(0.05)
    await asyncio.sleep(0.3)
    await worker.close()
    await broker.until(lambda: "chatty" not in broker.link.sessions)
    clock.now += 30  # 80 s since the hello, 30 s since it last spoke: time to reconnect
    await asyncio.sleep(0.3)
    assert broker.node.state.workers["chatty"].state == WorkerState.DISCONNECTED  # not dead
    clock.now += 31  # 61 s since it last spoke
    await broker.until(lambda: broker.node.state.workers["chatty"].state == WorkerState.DEAD)


async def test_the_leader_beats_after_half_the_timeout_of_sending_nothing(
    make_broker: BrokerFactory,
) -> None:
    # docs/DESIGN.md §8, "Heartbeats at scale": a worker judges the leader by any frame
    # within the timeout, so the leader beats a connection only after half the timeout
    # without sending it anything, not at the worker's own (much shorter) interval.
    clock = Monotonic()
    broker = await make_broker(
        link_clock=clock, heartbeat_interval_ms=50, heartbeat_timeout_ms=60_000
    )
    worker = broker.worker("w1", task_types={"*": 1})
    await worker.hello(heartbeats=False)
    worker.start_heartbeats(0.05)  # keeps the leader's last_seen at the test's clock
    rounds = 0.3  # real seconds: six rounds of the leader's heartbeat loop
    await asyncio.sleep(rounds)  # the loop sees the Welcome sent (at this clock)

    clock.now += 10  # 200 of its intervals, a sixth of the timeout: no beat yet
    await asyncio.sleep(rounds)
    assert worker.heartbeats_received == 0
    clock.now += 25  # 35 s since the Welcome: past half the timeout
    await broker.until(lambda: worker.heartbeats_received == 1)

    clock.now += 20
    [task_id] = await broker.submit()  # an Assign: the leader proved alive by it
    assign = await worker.expect(p.Assign)
    await asyncio.sleep(rounds)  # the loop sees the frame sent (at this clock)
    clock.now += 15  # 35 s since the last beat, 15 s since the Assign: no beat
    await asyncio.sleep(rounds)
    assert worker.heartbeats_received == 1
    clock.now += 20  # 35 s since the Assign
    await broker.until(lambda: worker.heartbeats_received == 2)
    assert assign.tasks[0].task_id == task_id
    await worker.close()
