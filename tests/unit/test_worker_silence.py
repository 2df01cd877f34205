"""A worker's silence survives a leader change (docs/DESIGN.md §8, "Silence across leader
changes"): WorkerSilent in the state machine, and leaders that each live less than the
heartbeat timeout still declare a silent worker dead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.core import StateMachine, WorkerState
from broker.core import entries as e
from broker.core.snapshot_body import decode_snapshot_body
from broker.replication.node import Node, NodeConfig, Stamp
from broker.workers.liveness import Liveness
from broker.workers.worker_link import WorkerLinkConfig
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore
from tests.support.link_broker import WAIT_S, BrokerFactory, Monotonic
from tests.support.machine import Machine

# --- the state machine ---------------------------------------------------------------------


def _silent(m: Machine, since_ms: int | None, worker_id: str = "w1") -> None:
    connected_ms = m.m.workers[worker_id].connected_ms
    entry = e.WorkerSilent(
        time_ms=m.now, workers=(e.SilentWorker(worker_id, since_ms, connected_ms),)
    )
    assert m.apply(entry) is None


def test_the_earliest_silence_is_kept_within_the_registration_and_now() -> None:
    m = Machine()
    m.register("w1")
    registered = m.now
    m.at(10_000)
    _silent(m, registered + 6_000)
    _silent(m, registered + 8_000)  # a later leader's view: the earlier stays
    assert m.m.workers["w1"].silent_since_ms == registered + 6_000
    _silent(m, registered + 4_000)
    assert m.m.workers["w1"].silent_since_ms == registered + 4_000
    _silent(m, registered - 5_000)  # before its registration: it was heard then
    assert m.m.workers["w1"].silent_since_ms == registered
    m.register("w2")
    _silent(m, m.now + 5_000, "w2")  # in the future: now
    assert m.m.workers["w2"].silent_since_ms == m.now


def test_a_registration_heard_again_or_death_clears_the_silence() -> None:
    m = Machine()
    for worker_id in ("w1", "w2", "w3"):
        m.register(worker_id)
    m.at(5_000)
    for worker_id in ("w1", "w2", "w3"):
        _silent(m, m.now - 1_000, worker_id)
    m.at(1)
    m.register("w1")
    _silent(m, None, "w2")  # beats again on its connection
    assert m.worker_dead("w3") is None
    assert [w.silent_since_ms for w in m.m.workers.values()] == [None, None, None]


def test_a_silence_of_an_earlier_registration_or_an_unknown_worker_is_skipped() -> None:
    m = Machine()
    m.register("w1")
    first = m.m.workers["w1"].connected_ms
    m.at(1_000)
    m.register("w1")  # registered again since the leader saw it silent
    entry = e.WorkerSilent(
        time_ms=m.at(1),
        workers=(e.SilentWorker("w1", first, first), e.SilentWorker("ghost", first, first)),
    )
    assert m.apply(entry) is None
    assert m.m.workers["w1"].silent_since_ms is None and "ghost" not in m.m.workers


def test_the_silence_round_trips_through_a_snapshot_of_body_version_3() -> None:
    m = Machine()
    m.register("w1")
    m.register("w2")
    m.at(7_000)
    _silent(m, m.now - 3_000)
    data = m.m.encode_snapshot()
    assert decode_snapshot_body(data).format_version == 3  # a version-2 reader drops it
    loaded = StateMachine.from_snapshot(data)
    loaded.check_invariants()
    assert loaded.digest() == m.m.digest()
    assert loaded.workers["w1"].silent_since_ms == m.now - 3_000
    assert loaded.workers["w2"].silent_since_ms is None


def test_the_entry_is_written_as_format_4_in_batches() -> None:
    entry = e.WorkerSilent(time_ms=1, workers=(e.SilentWorker("w1", 0, 0),))
    assert e.decode_entry(e.encode_entry(entry)).v == 4
    assert e.ENTRY_FORMAT_VERSION >= 4 and e.MAX_SILENT_BATCH == 1000


# --- leaders changing faster than the heartbeat timeout --------------------------------------

INTERVAL_MS = 1_000
TIMEOUT_MS = 10_000


class Clocks:
    """One injected time for the liveness (monotonic s) and the node's stamps (ms)."""

    def __init__(self) -> None:
        self.mono = 500.0
        self.wall_ms = 1_700_000_000_000

    def monotonic(self) -> float:
        return self.mono

    def now_ms(self) -> int:
        return self.wall_ms

    def advance(self, ms: int) -> None:
        self.mono += ms / 1000
        self.wall_ms += ms


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[Node, Clocks]]:
    clocks = Clocks()
    node = Node(
        NodeConfig(data_dir=tmp_path, snapshot_interval_s=3600.0, timer_poll_interval_s=3600.0),
        ledgers=MemoryLedgerStore(),
        ledger_list=MemoryLedgerListStore(),
        snapshots=SnapshotStore(tmp_path / "snapshots"),
        clock_ms=clocks.now_ms,
    )
    await node.start()
    yield node, clocks
    await node.stop(snapshot=False)
    node.state.check_invariants()


async def _register(node: Node, worker_id: str) -> None:
    def build(stamp: Stamp) -> e.Entry:
        return e.RegisterWorker(time_ms=stamp.now_ms, worker_id=worker_id, task_types={"*": 1})

    await node.propose(build)


def _leader(node: Node, clocks: Clocks) -> Liveness:
    """A new leader's liveness: it knows no connection, and judges from its start."""
    config = WorkerLinkConfig(heartbeat_interval_ms=INTERVAL_MS, heartbeat_timeout_ms=TIMEOUT_MS)
    return Liveness(node, config, {}, clocks.monotonic)


async def _lead(liveness: Liveness, clocks: Clocks, rounds: int, node: Node) -> int | None:
    """Beat ``rounds`` heartbeat rounds a heartbeat interval apart; the stamp time of the
    round that found the worker dead, if one did."""
    for seq in range(1, rounds + 1):
        clocks.advance(INTERVAL_MS)
        await liveness.beat(seq)
        if node.state.workers["w1"].state != WorkerState.CONNECTED:
            return clocks.wall_ms
    return None


async def test_a_worker_silent_through_leaders_shorter_than_the_timeout_is_declared_dead(
    node: tuple[Node, Clocks],
) -> None:
    state_node, clocks = node
    await _register(state_node, "w1")  # by a leader gone at once: no later leader heard it
    clocks.advance(2_000)
    first = _leader(state_node, clocks)
    started_ms = clocks.wall_ms  # never heard from: judged from the first leader's start
    # Each leader lives 6 s: a timeout never passes within one of them.
    assert await _lead(first, clocks, 6, state_node) is None
    [silence] = [w.silent_since_ms for w in state_node.state.workers.values()]
    assert silence == started_ms
    dead_at = None
    for _ in range(2):
        dead_at = await _lead(_leader(state_node, clocks), clocks, 6, state_node)
        if dead_at is not None:
            break
    assert dead_at is not None, "never declared dead"
    # Within the timeout and one heartbeat round of its last known contact.
    assert started_ms + TIMEOUT_MS < dead_at <= started_ms + TIMEOUT_MS + INTERVAL_MS
    assert state_node.state.workers["w1"].silent_since_ms is None


async def test_a_leader_writes_one_silence_entry_for_many_workers(
    node: tuple[Node, Clocks],
) -> None:
    state_node, clocks = node
    for index in range(5):
        await _register(state_node, f"w{index}")
    applied_before = state_node.state.entries_applied
    liveness = _leader(state_node, clocks)
    for seq in range(1, 8):
        clocks.advance(INTERVAL_MS)
        await liveness.beat(seq)
    # Half the timeout without a connection: one entry for all five, written once.
    assert state_node.state.entries_applied == applied_before + 1
    assert {w.silent_since_ms for w in state_node.state.workers.values()} == {
        clocks.wall_ms - 7 * INTERVAL_MS
    }


# --- the link: a connected worker ----------------------------------------------------------


async def test_a_beating_worker_causes_no_entry(make_broker: BrokerFactory) -> None:
    clock = Monotonic()
    broker = await make_broker(
        link_clock=clock, heartbeat_interval_ms=50, heartbeat_timeout_ms=60_000
    )
    worker = broker.worker("w1")
    await worker.hello(heartbeats=False)
    worker.start_heartbeats(0.05)
    session = broker.link.sessions["w1"]
    count = len(broker.applied)
    for _ in range(10):  # ten minutes of the link's clock, in steps of a third of the timeout
        clock.now += 20
        await broker.until(lambda: session.last_seen == clock.now)  # it beat at this clock
        await asyncio.sleep(0.15)  # three rounds of the leader's loop at this clock
    assert len(broker.applied) == count, broker.applied[count:]
    assert broker.node.state.workers["w1"].silent_since_ms is None


async def test_a_connection_silent_for_half_the_timeout_is_logged_until_it_beats_again(
    make_broker: BrokerFactory,
) -> None:
    clock = Monotonic()
    broker = await make_broker(
        link_clock=clock, heartbeat_interval_ms=50, heartbeat_timeout_ms=60_000
    )
    broker.clock.freeze()  # the stamps' clock moves with the link's
    worker = broker.worker("w1")
    await worker.hello(heartbeats=False)
    hello_ms = broker.node.state.workers["w1"].connected_ms
    await asyncio.sleep(0.2)
    clock.now += 31  # its connection silent past half the timeout
    assert broker.clock.frozen is not None
    broker.clock.frozen += 31_000
    await broker.until(lambda: bool(broker.entries(e.WorkerSilent)))
    [silent] = broker.entries(e.WorkerSilent)
    # Its last frame (the hello), mapped onto the stamp's clock.
    assert silent.workers[0].since_ms == hello_ms
    assert broker.node.state.workers["w1"].silent_since_ms == hello_ms
    worker.start_heartbeats(0.05)  # beats again: the silence is over
    await broker.until(lambda: broker.node.state.workers["w1"].silent_since_ms is None, WAIT_S)
    assert broker.node.state.workers["w1"].state == WorkerState.CONNECTED
    assert len(broker.entries(e.WorkerSilent)) == 2
