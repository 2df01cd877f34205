"""A closed worker connection shows at once (docs/DESIGN.md §8, "Closed connections"):
WorkerDisconnected in the state machine, its snapshot, the scheduler and the task view.
Through real processes: tests/integration/test_disconnected_worker.py."""

from __future__ import annotations

import asyncio

import msgspec

from broker.api.common import task_view
from broker.core import Rejected, StateMachine, TaskRef, TaskState, WorkerState
from broker.core import entries as e
from broker.core.scheduler import schedule
from broker.core.snapshot_body import decode_snapshot_body
from tests.support.link_broker import WAIT_S, BrokerFactory, Monotonic
from tests.support.machine import Machine


def _disconnected(m: Machine, worker_id: str = "w1", last_seen_ms: int | None = None) -> None:
    worker = m.m.workers[worker_id]
    closed = e.DisconnectedWorker(
        worker_id, m.now if last_seen_ms is None else last_seen_ms, worker.connected_ms
    )
    assert m.apply(e.WorkerDisconnected(time_ms=m.now, workers=(closed,))) is None


def _running(m: Machine, worker_id: str = "w1") -> int:
    """A task running on a fresh registration of ``worker_id``."""
    m.apply(e.RegisterWorker(time_ms=m.now, worker_id=worker_id, task_types={"*": 2}))
    task_id = m.add()
    assert m.assign(task_id, worker_id) == TaskRef(task_id, TaskState.RUNNING)
    return task_id


def test_a_closed_connection_disconnects_the_worker_and_leaves_its_tasks_running() -> None:
    m = Machine()
    task_id = _running(m)
    last_frame_ms = m.now
    m.at(3_000)
    _disconnected(m, last_seen_ms=last_frame_ms + 1_000)
    worker = m.m.workers["w1"]
    assert worker.state == WorkerState.DISCONNECTED
    assert worker.updated_ms == m.now  # when it disconnected: the task view's lost? time
    assert worker.silent_since_ms == last_frame_ms + 1_000  # the timeout runs from its last frame
    task = m.m.tasks[task_id]
    assert (task.state, task.worker, task.lost, task.attempt) == (TaskState.RUNNING, "w1", 0, 1)
    assert m.m.capacity().connected_workers == 0


def test_a_close_of_an_earlier_registration_or_an_unknown_worker_is_skipped() -> None:
    m = Machine()
    m.register("w1")
    first = m.m.workers["w1"].connected_ms
    m.at(1_000)
    m.register("w1")  # connected again before the leader logged the close
    entry = e.WorkerDisconnected(
        time_ms=m.at(1),
        workers=(
            e.DisconnectedWorker("w1", first, first),
            e.DisconnectedWorker("ghost", first, first),
        ),
    )
    assert m.apply(entry) is None
    assert m.m.workers["w1"].state == WorkerState.CONNECTED and "ghost" not in m.m.workers
    assert m.m.workers["w1"].silent_since_ms is None


def test_a_disconnected_worker_that_registers_again_keeps_the_tasks_it_reports() -> None:
    m = Machine()
    task_id = _running(m)
    m.at(2_000)
    _disconnected(m)
    m.at(2_000)
    result = m.register("w1", running=(e.TaskAttempt(task_id, 1),))
    assert result.keep == (e.TaskAttempt(task_id, 1),) and result.lost == ()
    worker = m.m.workers["w1"]
    assert (worker.state, worker.silent_since_ms) == (WorkerState.CONNECTED, None)
    assert m.m.tasks[task_id].state == TaskState.RUNNING and m.m.tasks[task_id].lost == 0


def test_a_disconnected_worker_declared_dead_loses_its_tasks_as_lost() -> None:
    m = Machine()
    task_id = _running(m)
    connected_ms = m.m.workers["w1"].connected_ms
    m.at(1_000)
    _disconnected(m)
    m.at(10_000)
    dead = e.WorkerDead(
        time_ms=m.now, worker_id="w1", connected_ms=connected_ms, v=e.LOST_ATTEMPTS_VERSION
    )
    assert m.apply(dead) is None
    assert m.m.workers["w1"].state == WorkerState.DEAD
    task = m.m.tasks[task_id]
    assert (task.state, task.lost, task.counted_attempts()) == (TaskState.WAITING, 1, 0)


def test_a_disconnected_worker_is_never_placed_on() -> None:
    m = Machine()
    _running(m)  # one of its two slots is free
    m.at(1_000)
    _disconnected(m)
    waiting = m.add()
    assert schedule(m.m) == []
    refused = m.assign(waiting, "w1")
    assert isinstance(refused, Rejected) and refused.code == "stale"
    # Nor by a submit's own placement (apply re-checks what the scheduler checks).
    placed = e.SubmitTasks(
        time_ms=m.now,
        tasks=(m.spec(),),
        assignments=(e.Assignment(m.m.max_task_id + 1, "w1"),),
        v=e.STARTS_RECORDED_VERSION,
    )
    m.apply(placed)
    assert m.m.tasks[m.m.max_task_id].state == TaskState.WAITING
    m.register("w2")  # registered with no capacity: still nothing
    assert schedule(m.m) == []
    m.apply(e.RegisterWorker(time_ms=m.now, worker_id="w1", task_types={"*": 4}))
    assert {a.worker_id for a in schedule(m.m)} == {"w1"}  # back: placed again


def test_the_disconnected_worker_round_trips_through_a_snapshot_of_body_version_4() -> None:
    m = Machine()
    _running(m)
    m.at(5_000)
    _disconnected(m, last_seen_ms=m.now - 2_000)
    data = m.m.encode_snapshot()
    assert decode_snapshot_body(data).format_version == 4  # a version-3 reader: dead worker
    loaded = StateMachine.from_snapshot(data)
    loaded.check_invariants()
    assert loaded.digest() == m.m.digest()
    worker = loaded.workers["w1"]
    assert (worker.state, worker.silent_since_ms) == (WorkerState.DISCONNECTED, m.now - 2_000)
    assert loaded.capacity().connected_workers == 0


def test_the_entry_is_written_as_format_5() -> None:
    entry = e.WorkerDisconnected(time_ms=1, workers=(e.DisconnectedWorker("w1", 0, 0),))
    assert e.decode_entry(e.encode_entry(entry)).v == 5
    assert e.ENTRY_FORMAT_VERSION >= 5 and e.MAX_DISCONNECTED_BATCH == 1000


def test_the_task_view_shows_a_running_task_of_a_disconnected_worker_lost_suspected() -> None:
    m = Machine()
    task_id = _running(m)
    view = task_view(m.m.tasks[task_id], None, m.m.workers)
    assert (view.worker_state, view.lost_suspected_at) == ("connected", None)
    m.at(1_000)
    _disconnected(m)
    view = msgspec.json.decode(
        msgspec.json.encode(task_view(m.m.tasks[task_id], None, m.m.workers))
    )
    assert view["state"] == "running" and view["worker_state"] == "disconnected"
    assert view["lost_suspected_at"] is not None
    waiting = task_view(m.m.tasks[m.add()], None, m.m.workers)
    assert (waiting.worker_state, waiting.lost_suspected_at) == (None, None)


# --- the link: the leader logs a close at once ---------------------------------------------


async def test_the_leader_logs_a_closed_connection_at_once_with_its_last_frame(
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
    clock.now += 5  # five seconds after its last frame (the hello), its connection closes
    assert broker.clock.frozen is not None
    broker.clock.frozen += 5_000
    await worker.close()
    await broker.until(lambda: bool(broker.entries(e.WorkerDisconnected)))
    [closed] = broker.entries(e.WorkerDisconnected)
    assert closed.workers == (e.DisconnectedWorker("w1", hello_ms, hello_ms),)
    registered = broker.node.state.workers["w1"]
    assert (registered.state, registered.silent_since_ms) == (WorkerState.DISCONNECTED, hello_ms)
    # Back within the timeout: connected again, no death.
    again = broker.worker("w1")
    await again.hello(heartbeats=False)
    assert broker.node.state.workers["w1"].state == WorkerState.CONNECTED
    assert broker.entries(e.WorkerDead) == []


async def test_the_link_stopping_logs_no_close(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    worker = broker.worker("w1")
    await worker.hello()
    count = len(broker.applied)
    await broker.link.stop()
    await worker.wait_closed_by_peer(wait_s=WAIT_S)
    await asyncio.sleep(0.1)  # a close it logged would be applied by now
    assert broker.applied[count:] == []
    assert broker.node.state.workers["w1"].state == WorkerState.CONNECTED
