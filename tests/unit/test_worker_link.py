"""The leader's worker endpoint (broker/workers/worker_link.py) against fake workers over real TCP.

Each test runs a Node on in-memory ledgers with a WorkerLink on an ephemeral
port, heartbeats every 100 ms and a 600 ms heartbeat timeout, and drives it
with :class:`tests.support.fake_worker.FakeWorker`. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable

import pytest

from broker.core import ApplyResult, TaskState, WorkerState
from broker.core import entries as e
from broker.replication.node import Stamp
from tests.support.fake_worker import FakeWorker
from tests.support.link_broker import (
    BROKER_ID,
    INTERVAL_MS,
    TIMEOUT_MS,
    WAIT_S,
    Broker,
    BrokerFactory,
)
from wire import worker_protocol as p


def attempts(message: p.Assign | p.FinishAck | p.Cancel) -> list[tuple[int, int]]:
    """(task id, attempt) of each task a message carries."""
    return [(t.task_id, t.attempt) for t in message.tasks]


def pairs(items: tuple[p.TaskAttempt, ...]) -> list[tuple[int, int]]:
    return [(t.task_id, t.attempt) for t in items]


# --- 1. handshake ---------------------------------------------------------------------------


async def test_handshake_welcome_and_registration(broker: Broker) -> None:
    worker = broker.worker(
        "w1",
        process_id="proc-42",
        task_types={"*": 2, "spark": 1},
        resources={"cpu": 8, "memory_mb": 16000},
        tenants=("a", "b"),
    )
    welcome = await worker.hello()

    assert welcome.broker_id == BROKER_ID
    assert welcome.heartbeat_interval_ms == INTERVAL_MS
    assert welcome.heartbeat_timeout_ms == TIMEOUT_MS
    assert welcome.keep == () and welcome.drop == ()
    state = broker.node.state.workers["w1"]
    assert state.state == WorkerState.CONNECTED
    assert state.process_id == "proc-42"
    assert state.task_types == {"*": 2, "spark": 1}
    assert state.resources == {"cpu": 8.0, "memory_mb": 16000.0}
    assert state.tenants == ["a", "b"]
    assert state.address.startswith("127.0.0.1:")
    assert len(broker.entries(e.RegisterWorker)) == 1
    # The broker heartbeats too.
    await broker.until(lambda: worker.heartbeats_received >= 2)


async def test_welcome_carries_the_weights_of_tenants_not_weighing_one(broker: Broker) -> None:
    # The worker's Spark fair pools take them (clients/worker/spark/pools.py).
    for name, weight in (("heavy", 3.0), ("plain", 1.0)):

        def build(stamp: Stamp, name: str = name, weight: float = weight) -> e.Entry:
            limits = e.TenantLimitsPatch(weight=weight)
            return e.SetTenant(time_ms=stamp.now_ms, tenant=name, limits=limits)

        await broker.node.propose(build)
    welcome = await broker.worker("w1").hello()
    assert welcome.tenant_weights == {"heavy": 3.0}


# --- 2. assignments -------------------------------------------------------------------------


async def test_assignments_are_logged_first_and_respect_capacity(broker: Broker) -> None:
    worker = broker.worker("w1", task_types={"*": 2})
    await worker.hello()
    ids = await broker.submit(5, params=b'{"n": 1}')

    first = await worker.expect(p.Assign)
    received = list(first.tasks)
    # The log comes first: every task is already running on w1 when its frame arrives.
    for task in received:
        state = broker.task(task.task_id)
        assert state.state == TaskState.RUNNING and state.worker == "w1"
        assert any(
            task.task_id in {a.task_id for a in entry.assignments}
            for entry in broker.entries(e.AssignTasks)
        )
    while len(received) < 2:
        received += (await worker.expect(p.Assign)).tasks
    assert [t.task_id for t in received] == ids[:2]  # FIFO
    for task in received:
        assert (task.attempt, task.type, task.tenant, task.params) == (1, "noop", "t", b'{"n": 1}')

    # Capacity 2: nothing more while both run.
    await worker.expect_none(p.Assign, within=0.3)
    assert [broker.task(i).state for i in ids] == [TaskState.RUNNING] * 2 + [TaskState.WAITING] * 3

    worker.finish_ok(ids[0], 1)
    nxt = await worker.expect(p.Assign)
    assert attempts(nxt) == [(ids[2], 1)]
    await worker.expect(p.FinishAck)
    await worker.expect_none(p.Assign, within=0.3)
    assert broker.task(ids[3]).state == TaskState.WAITING


async def test_assignments_over_one_frame_go_in_several_assign_frames(
    make_broker: BrokerFactory,
) -> None:
    # 40 tasks of 10 KiB params are over one 64 KiB frame: one Assign could not be sent
    # (the connection was closed, the worker reconnected and its attempts were lost).
    broker = await make_broker(max_frame_bytes=64 * 1024)
    worker = broker.worker("w1", task_types={"*": 40})
    await worker.hello()
    params = b'"' + b"x" * (10 * 1024) + b'"'
    ids = await broker.submit(40, params=params)
    received: list[p.AssignedTask] = []
    frames = 0
    while len(received) < len(ids):
        received += (await worker.expect(p.Assign)).tasks
        frames += 1
    assert sorted(t.task_id for t in received) == ids
    assert all(t.params == params for t in received)
    assert frames >= 40 * 10 * 1024 // (64 * 1024)
    assert not worker.closed_by_peer
    assert [broker.task(i).state for i in ids] == [TaskState.RUNNING] * 40


# --- 3. finish reports ----------------------------------------------------------------------


async def test_finish_ok_duplicate_and_acknowledgement(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [task_id] = await broker.submit()
    await worker.expect(p.Assign)

    worker.finish_ok(task_id, 1, b'{"answer": 42}')
    ack = await worker.expect(p.FinishAck)
    assert attempts(ack) == [(task_id, 1)]
    task = broker.task(task_id)
    assert task.state == TaskState.FINISHED
    assert task.result == b'{"answer": 42}'
    assert task.error is None

    # A duplicate (the ack was lost, say) is acknowledged again and changes nothing.
    # Freeze the clock and bring the state's time to it: only the report may change it now.
    broker.clock.freeze()
    await broker.node.propose(lambda stamp: e.Tick(time_ms=stamp.now_ms))
    digest = broker.node.state.digest()
    finishes = len(broker.entries(e.FinishTasks))
    worker.finish(
        p.TaskReport(task_id=task_id, attempt=1, ok=True, result=b'"other"'),
        p.TaskReport(task_id=task_id, attempt=1, ok=False, error="late failure"),
    )
    ack = await worker.expect(p.FinishAck)
    assert attempts(ack) == [(task_id, 1), (task_id, 1)]
    # Reports of an attempt that is over are acknowledged without logging anything.
    assert len(broker.entries(e.FinishTasks)) == finishes
    assert broker.node.state.digest() == digest
    assert broker.task(task_id).result == b'{"answer": 42}'


async def test_result_that_is_not_json_fails_the_task(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [task_id] = await broker.submit(max_attempts=1)
    await worker.expect(p.Assign)

    worker.finish_ok(task_id, 1, b"{not json")
    assert attempts(await worker.expect(p.FinishAck)) == [(task_id, 1)]
    task = broker.task(task_id)
    assert task.state == TaskState.ERROR
    assert task.result is None
    assert task.error is not None and "JSON" in task.error


async def test_failure_report_errors_the_task(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [task_id] = await broker.submit(max_attempts=1)
    await worker.expect(p.Assign)

    worker.finish_failed(task_id, 1, "ZeroDivisionError: division by zero")
    assert attempts(await worker.expect(p.FinishAck)) == [(task_id, 1)]
    task = broker.task(task_id)
    assert task.state == TaskState.ERROR
    assert task.error is not None and "ZeroDivisionError: division by zero" in task.error
    await worker.expect_none(p.Assign, within=0.2)


async def test_failure_requeues_and_late_finish_of_old_attempt_is_ignored(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [task_id] = await broker.submit(max_attempts=2)
    assert attempts(await worker.expect(p.Assign)) == [(task_id, 1)]

    worker.finish_failed(task_id, 1, "flaky")
    retry = await worker.expect(p.Assign)
    assert attempts(retry) == [(task_id, 2)]
    await worker.expect(p.FinishAck)
    assert broker.task(task_id).state == TaskState.RUNNING
    assert broker.task(task_id).attempt == 2

    # A report for attempt 1 arriving now is acknowledged but does nothing.
    worker.finish_ok(task_id, 1, b'"stale"')
    assert attempts(await worker.expect(p.FinishAck)) == [(task_id, 1)]
    task = broker.task(task_id)
    assert (task.state, task.attempt, task.result) == (TaskState.RUNNING, 2, None)

    worker.finish_ok(task_id, 2, b'"fresh"')
    await worker.expect(p.FinishAck)
    task = broker.task(task_id)
    assert (task.state, task.attempt, task.result) == (TaskState.FINISHED, 2, b'"fresh"')


# --- 4. dead workers ------------------------------------------------------------------------


async def test_dead_worker_task_is_requeued_to_another_worker(broker: Broker) -> None:
    w1 = broker.worker("w1")
    await w1.hello()
    [task_id] = await broker.submit(max_attempts=2)
    await w1.expect(p.Assign)
    # Connected (and heartbeating) for longer than the timeout: the clock starts at the drop.
    await asyncio.sleep(TIMEOUT_MS / 1000 + 0.2)
    assert broker.entries(e.WorkerDead) == []

    await w1.close()
    closed_at = time.monotonic()
    await broker.until(lambda: broker.node.state.workers["w1"].state == WorkerState.DEAD)
    assert time.monotonic() - closed_at >= TIMEOUT_MS / 1000 * 0.8  # not before the timeout
    [dead] = broker.entries(e.WorkerDead)
    assert dead.worker_id == "w1"
    task = broker.task(task_id)
    assert (task.state, task.attempt, task.worker) == (TaskState.WAITING, 1, None)

    w2 = broker.worker("w2")
    await w2.hello()
    assert attempts(await w2.expect(p.Assign)) == [(task_id, 2)]
    assert broker.task(task_id).worker == "w2"


async def test_dead_workers_task_runs_again_without_using_an_attempt(broker: Broker) -> None:
    """A task of max_attempts 1 whose worker dies is not failed: the attempt was lost, not
    used (docs/DESIGN.md §6, "Lost workers"); the next worker runs it."""
    w1 = broker.worker("w1")
    await w1.hello()
    [task_id] = await broker.submit(max_attempts=1)
    await w1.expect(p.Assign)

    await w1.close()
    await broker.until(lambda: broker.task(task_id).state == TaskState.WAITING)
    assert broker.node.state.workers["w1"].state == WorkerState.DEAD
    task = broker.task(task_id)
    assert task.error is not None and "w1" in task.error and "died" in task.error
    assert (task.attempt, task.lost, task.counted_attempts()) == (1, 1, 0)
    [dead] = broker.entries(e.WorkerDead)
    assert dead.v == e.LOST_ATTEMPTS_VERSION
    w2 = broker.worker("w2")
    await w2.hello()
    assert attempts(await w2.expect(p.Assign)) == [(task_id, 2)]
    w2.finish_ok(task_id, 2, b"1")
    await w2.expect(p.FinishAck)
    assert broker.task(task_id).state == TaskState.FINISHED


async def test_dead_worker_task_errors_past_its_max_lost(broker: Broker) -> None:
    w1 = broker.worker("w1")
    await w1.hello()
    [task_id] = await broker.submit(max_attempts=1, max_lost=0)
    await w1.expect(p.Assign)

    await w1.close()
    await broker.until(lambda: broker.task(task_id).state == TaskState.ERROR)
    error = broker.task(task_id).error
    assert error is not None and "w1" in error and "died" in error
    assert "(lost 1 times, max_lost 0)" in error


# --- 5. silent workers ----------------------------------------------------------------------


async def test_silent_worker_is_disconnected(broker: Broker) -> None:
    silent = broker.worker("silent")
    lively = broker.worker("lively")
    await silent.hello(heartbeats=False)
    welcomed_at = time.monotonic()
    await lively.hello()

    await silent.wait_closed_by_peer(wait_s=WAIT_S)
    assert time.monotonic() - welcomed_at >= TIMEOUT_MS / 1000 * 0.8
    # The one that heartbeats stays connected.
    assert not lively.closed_by_peer
    assert "lively" in broker.link.sessions
    await broker.until(lambda: "silent" not in broker.link.sessions)


# --- 6. reconnection ------------------------------------------------------------------------


@pytest.mark.parametrize("drop_first", [True, False], ids=["dropped", "half-open"])
async def test_quick_reconnect_keeps_the_running_task(broker: Broker, drop_first: bool) -> None:
    worker = broker.worker("w1")
    await worker.hello()
    [task_id] = await broker.submit(max_attempts=3)
    await worker.expect(p.Assign)

    if drop_first:
        await worker.close()
        again = broker.worker("w1")
    else:
        # The old connection still looks open to the broker but went silent (half-open):
        # past three heartbeat intervals the new hello replaces it. (While it still
        # heartbeats a second hello is refused: tests/security/test_worker_credentials.py.)
        worker.stop_heartbeats()
        await asyncio.sleep(3 * INTERVAL_MS / 1000 + 0.1)
        again = broker.worker("w1")
    welcome = await again.hello(running=[(task_id, 1)])
    if not drop_first:
        await worker.wait_closed_by_peer()
    assert pairs(welcome.keep) == [(task_id, 1)]
    assert welcome.drop == ()
    task = broker.task(task_id)
    assert (task.state, task.attempt, task.worker) == (TaskState.RUNNING, 1, "w1")

    # Past the heartbeat timeout it is still alive (no WorkerDead from the old connection).
    await asyncio.sleep(TIMEOUT_MS / 1000 + 0.3)
    assert broker.entries(e.WorkerDead) == []
    assert broker.task(task_id).state == TaskState.RUNNING
    await again.expect_none(p.Assign, within=0.01)

    again.finish_ok(task_id, 1, b"7")
    await again.expect(p.FinishAck)
    task = broker.task(task_id)
    assert (task.state, task.attempt, task.result) == (TaskState.FINISHED, 1, b"7")
    # Nothing lost: the registrations stay in the oldest format (an older follower reads it).
    assert {r.v for r in broker.entries(e.RegisterWorker)} == {e.BASE_ENTRY_FORMAT_VERSION}


@pytest.mark.parametrize("max_attempts", [2, 1])
async def test_restarted_worker_loses_its_tasks(broker: Broker, max_attempts: int) -> None:
    worker = broker.worker("w1", process_id="proc-1")
    await worker.hello()
    [task_id] = await broker.submit(max_attempts=max_attempts)
    await worker.expect(p.Assign)
    await worker.close()

    restarted = broker.worker("w1", process_id="proc-2")
    welcome = await restarted.hello(running=[])
    assert welcome.keep == () and welcome.drop == ()
    assert broker.node.state.workers["w1"].process_id == "proc-2"
    # Lost with the restart, not used: whatever max_attempts, it runs again (docs/DESIGN.md
    # §6, "Lost workers").
    assert attempts(await restarted.expect(p.Assign)) == [(task_id, 2)]
    task = broker.task(task_id)
    assert (task.state, task.lost) == (TaskState.RUNNING, 1)
    assert task.error is not None and "w1 came back without" in task.error
    assert [r.v for r in broker.entries(e.RegisterWorker)] == [1, e.LOST_ATTEMPTS_VERSION]


async def test_reconnect_reporting_a_task_no_longer_running_there_is_told_to_drop_it(
    broker: Broker,
) -> None:
    worker = broker.worker("w1")
    await worker.hello()
    kept_id, cancelled_id = await broker.submit(2)
    assigned = attempts(await worker.expect(p.Assign))
    while len(assigned) < 2:
        assigned += attempts(await worker.expect(p.Assign))
    await worker.close()
    await broker.cancel(cancelled_id)  # while it is away: nobody to tell

    again = broker.worker("w1")
    welcome = await again.hello(running=[(kept_id, 1), (cancelled_id, 1), (999, 1)])
    assert pairs(welcome.keep) == [(kept_id, 1)]
    assert sorted(pairs(welcome.drop)) == [(cancelled_id, 1), (999, 1)]
    assert broker.task(cancelled_id).state == TaskState.CANCELLED
    assert broker.task(kept_id).state == TaskState.RUNNING


# --- 7. cancels -----------------------------------------------------------------------------


async def test_cancel_of_a_running_task_is_sent_to_its_worker(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [task_id] = await broker.submit()
    await worker.expect(p.Assign)

    await broker.cancel(task_id, reason="user changed their mind")
    cancel = await worker.expect(p.Cancel)
    assert attempts(cancel) == [(task_id, 1)]
    assert cancel.reason == "user changed their mind"
    assert broker.task(task_id).state == TaskState.CANCELLED


async def test_deadline_of_a_running_task_sends_cancel(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [task_id] = await broker.submit(deadline_in_ms=700)
    assign = await worker.expect(p.Assign)
    assert assign.tasks[0].deadline_ms == broker.task(task_id).deadline_ms

    cancel = await worker.expect(p.Cancel, wait_s=WAIT_S)
    assert attempts(cancel) == [(task_id, 1)]
    assert "deadline" in cancel.reason
    task = broker.task(task_id)
    assert task.state == TaskState.ERROR
    assert task.error is not None and "deadline" in task.error
    assert broker.entries(e.Tick)  # the node's timer loop logged the tick that fired it


async def test_cancel_and_deadline_in_one_entry_keep_their_own_reasons(
    make_broker: BrokerFactory,
) -> None:
    # Timers only fire with the next entry: here, the cancel of the other task.
    broker = await make_broker({"timer_poll_interval_s": 3600.0})
    now = broker.clock.freeze()
    worker = broker.worker(task_types={"*": 2})
    await worker.hello()
    [timed] = await broker.submit(deadline_in_ms=1000)
    [other] = await broker.submit()
    seen = attempts(await worker.expect(p.Assign))
    while len(seen) < 2:
        seen += attempts(await worker.expect(p.Assign))

    broker.clock.frozen = now + 2000
    await broker.cancel(other, reason="cancelled by request")
    reasons: dict[int, str] = {}
    while len(reasons) < 2:
        cancel = await worker.expect(p.Cancel)
        for task_id, _ in attempts(cancel):
            reasons[task_id] = cancel.reason
    assert "deadline" in reasons[timed]
    assert reasons[other] == "cancelled by request"
    assert broker.task(timed).state == TaskState.ERROR
    assert broker.task(other).state == TaskState.CANCELLED


# --- 8. bad input ---------------------------------------------------------------------------


async def _expect_error_and_close(worker: FakeWorker, code: str) -> p.Error:
    error = await worker.expect(p.Error)
    assert error.code == code, error
    await worker.wait_closed_by_peer()
    return error


async def test_bad_connections_are_refused_while_others_are_served(broker: Broker) -> None:
    good = broker.worker("good", task_types={"*": 1})
    await good.hello()
    [first] = await broker.submit()
    assert attempts(await good.expect(p.Assign)) == [(first, 1)]

    async def garbage_after_hello() -> None:
        bad = broker.worker("bad-frame", task_types={})
        await bad.hello()
        bad.send_raw(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # 0xc1: never valid msgpack
        await _expect_error_and_close(bad, "bad_frame")

    async def garbage_before_hello() -> None:
        bad = broker.worker("unused")
        await bad.connect()
        bad.send_raw(struct.pack(">I", 4) + b"\xc1\x00\xff\xfe")
        await _expect_error_and_close(bad, "bad_frame")

    async def oversized() -> None:
        bad = broker.worker("unused")
        await bad.connect()
        bad.send_raw(b"\xff\xff\xff\xff" + b"x" * 100)
        await _expect_error_and_close(bad, "frame_too_large")

    async def sends_assign() -> None:
        bad = broker.worker("bad-assign", task_types={})
        await bad.hello()
        bad.send(p.Assign(tasks=(p.AssignedTask(task_id=first, attempt=1, type="x", tenant="t"),)))
        await _expect_error_and_close(bad, "unexpected_message")

    async def no_hello() -> None:
        bad = broker.worker("unused")
        await bad.connect()
        bad.send(p.Heartbeat(seq=1))
        await _expect_error_and_close(bad, "bad_handshake")

    async def bad_worker_id() -> None:
        bad = broker.worker("not a valid name!")
        await bad.connect()
        bad.send(p.Hello(worker_id="not a valid name!", task_types={"*": 1}))
        error = await _expect_error_and_close(bad, "bad_handshake")
        assert "worker_id" in error.message

    await asyncio.wait_for(
        asyncio.gather(
            garbage_after_hello(),
            garbage_before_hello(),
            oversized(),
            sends_assign(),
            no_hello(),
            bad_worker_id(),
        ),
        WAIT_S * 2,
    )
    assert "not a valid name!" not in broker.node.state.workers
    assert broker.task(first).state == TaskState.RUNNING  # nobody touched it

    # The good worker is still connected and served.
    assert not good.closed_by_peer
    good.finish_ok(first, 1)
    assert attempts(await good.expect(p.FinishAck)) == [(first, 1)]
    [second] = await broker.submit()
    assert attempts(await good.expect(p.Assign)) == [(second, 1)]
    good.finish_ok(second, 1)
    await good.expect(p.FinishAck)
    assert broker.task(second).state == TaskState.FINISHED


async def test_wrong_token_is_unauthorized(make_broker: BrokerFactory) -> None:
    broker = await make_broker(token="s3cret")

    for token in ("wrong", None):
        intruder = broker.worker("intruder", token=token)
        await intruder.connect()
        intruder.send(p.Hello(worker_id="intruder", token=token, task_types={"*": 1}))
        await _expect_error_and_close(intruder, "unauthorized")
    assert "intruder" not in broker.node.state.workers

    trusted = broker.worker("trusted", token="s3cret")
    welcome = await trusted.hello()
    assert welcome.broker_id == BROKER_ID
    [task_id] = await broker.submit()
    assert attempts(await trusted.expect(p.Assign)) == [(task_id, 1)]


# --- 9. tenant filter -----------------------------------------------------------------------


async def test_worker_serving_one_tenant_never_gets_another_tenants_tasks(broker: Broker) -> None:
    only_a = broker.worker("only-a", task_types={"*": 10}, tenants=("a",))
    await only_a.hello()
    b_ids = await broker.submit(2, tenant="b")
    a_ids = await broker.submit(1, tenant="a")

    assign = await only_a.expect(p.Assign)
    assert attempts(assign) == [(a_ids[0], 1)]
    assert assign.tasks[0].tenant == "a"
    await only_a.expect_none(p.Assign, within=0.4)
    assert [broker.task(i).state for i in b_ids] == [TaskState.WAITING] * 2

    # They were runnable all along: a worker serving everyone takes them.
    anyone = broker.worker("anyone", task_types={"*": 10})
    await anyone.hello()
    got = attempts(await anyone.expect(p.Assign))
    while len(got) < 2:
        got += attempts(await anyone.expect(p.Assign))
    assert sorted(got) == [(i, 1) for i in b_ids]
    await only_a.expect_none(p.Assign, within=0.1)


# --- races ----------------------------------------------------------------------------------


async def test_worker_is_not_declared_dead_while_its_registration_completes(
    broker: Broker,
) -> None:
    # The link has run for longer than the heartbeat timeout before the worker arrives.
    await asyncio.sleep(TIMEOUT_MS / 1000 + 0.2)
    propose = broker.node.propose

    async def slow_registration(build: Callable[[Stamp], e.Entry]) -> ApplyResult:
        made: list[e.Entry] = []

        def capture(stamp: Stamp) -> e.Entry:
            made.append(build(stamp))
            return made[-1]

        result = await propose(capture)
        if isinstance(made[0], e.RegisterWorker):
            # The registering coroutine resumes late (a busy loop): the heartbeat
            # loop runs in between and must not see a connected worker without contact.
            await asyncio.sleep(3 * INTERVAL_MS / 1000)
        return result

    broker.node.propose = slow_registration  # type: ignore[method-assign]
    worker = broker.worker("w1")
    await worker.hello()
    assert broker.entries(e.WorkerDead) == []
    assert broker.node.state.workers["w1"].state == WorkerState.CONNECTED
    [task_id] = await broker.submit()
    assert attempts(await worker.expect(p.Assign)) == [(task_id, 1)]


# --- task trees: spawn requests in finish reports --------------------------------------------


async def finish_spawning(broker: Broker, worker: FakeWorker, *spawn: p.SpawnRequest) -> int:
    """Submit a tracked root, take its assignment and finish it, spawning ``spawn``."""
    [root] = await broker.submit(track_tree=True)
    await worker.expect(p.Assign)
    worker.finish(p.TaskReport(task_id=root, attempt=1, ok=True, spawn=spawn))
    await worker.expect(p.FinishAck)
    return root


async def spawn_is_refused(
    broker: Broker, worker: FakeWorker, request_: p.SpawnRequest, message: str
) -> int:
    """Spawning ``request_`` fails the spawning task with an error that says ``message``."""
    root = await finish_spawning(broker, worker, request_)
    task = broker.task(root)
    assert task.state == TaskState.ERROR
    assert task.error is not None and message in task.error, task.error
    return root


async def test_spawned_children_get_leader_ids_and_complete_the_tree(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    root = await finish_spawning(
        broker,
        worker,
        p.SpawnRequest(type="child", params=b'{"i":0}'),
        p.SpawnRequest(type="child", params=b'{"i":1}', tenant="t2"),
        p.SpawnRequest(type="side", tracked=False),
    )
    [finish] = broker.entries(e.FinishTasks)
    children = [s.task.id for s in finish.outcomes[0].spawn]
    assert children == [root + 1, root + 2, root + 3]
    assert [s.anchors for s in finish.outcomes[0].spawn] == [(root,), (root,), ()]
    state = broker.node.state
    assert [state.tasks[c].tenant for c in children] == ["t", "t2", "t"]
    assert [state.tasks[c].root for c in children] == [root, root, None]
    assert [state.tasks[c].parent for c in children] == [root, root, root]
    tree = state.tree(root)
    assert tree is not None and tree.state == "pending"

    # The next submission's ids follow the children's.
    [later] = await broker.submit()
    assert later == root + 4
    assigned: set[int] = set()
    while len(assigned) < 4:
        assign = await worker.expect(p.Assign)
        assigned |= {t.task_id for t in assign.tasks}
    for child in children[:2]:
        worker.finish_ok(child, 1)
        await worker.expect(p.FinishAck)
    assert tree.state == "completed"


async def test_a_spawned_child_keeps_its_own_max_lost(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    root = await finish_spawning(
        broker, worker, p.SpawnRequest(type="child", max_lost=0), p.SpawnRequest(type="plain")
    )
    [finish] = broker.entries(e.FinishTasks)
    assert finish.v == e.LOST_ATTEMPTS_VERSION  # an older broker would drop it
    state = broker.node.state
    assert [state.tasks[root + i].max_lost for i in (1, 2)] == [0, e.DEFAULT_MAX_LOST]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (p.SpawnRequest(type="bad type"), "invalid spawn #0 (type 'bad type'): type must be"),
        (p.SpawnRequest(type="x", tracked=False, anchors=(1,)), "untracked child takes no"),
        (p.SpawnRequest(type="x", anchors=(0,)), "anchors must be task ids"),
        (p.SpawnRequest(type="x", params=b"{nope"), "params are not JSON"),
        (p.SpawnRequest(type="x", max_lost=101), "max_lost must be between 0 and 100"),
        (p.SpawnRequest(type="x", max_attempts=0), "max_attempts must be"),
        (p.SpawnRequest(type="x", tenant="no tenant"), "tenant must be"),
    ],
)
async def test_invalid_spawn_fails_the_task_with_a_clear_error(
    broker: Broker, request_: p.SpawnRequest, message: str
) -> None:
    worker = broker.worker()
    await worker.hello()
    root = await spawn_is_refused(broker, worker, request_, message)
    assert len(broker.node.state.tasks) == 1
    tree = broker.node.state.tree(root)
    assert tree is not None and tree.state == "failed"
    # The connection survives: the worker keeps being served.
    [other] = await broker.submit()
    assign = await worker.expect(p.Assign)
    assert [t.task_id for t in assign.tasks] == [other]


async def test_failed_report_spawns_nothing(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [root] = await broker.submit(track_tree=True, max_attempts=2)
    await worker.expect(p.Assign)
    worker.finish(
        p.TaskReport(
            task_id=root, attempt=1, ok=False, error="boom", spawn=(p.SpawnRequest(type="x"),)
        )
    )
    await worker.expect(p.FinishAck)
    assert list(broker.node.state.tasks) == [root]
    assert broker.task(root).state in (TaskState.WAITING, TaskState.RUNNING)


async def test_with_tenant_isolation_a_task_spawns_only_in_its_own_tenant(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(tenant_isolation=True)
    # An artifact uploaded by tenant "other" (authentication on: it owns it).
    await broker.node.propose(
        lambda stamp: e.AddCode(
            time_ms=stamp.now_ms, sha256="a" * 64, name="o.py", size_bytes=1, tenant="other"
        )
    )
    worker = broker.worker()
    await worker.hello()
    for request_, message in [
        (p.SpawnRequest(type="x", tenant="other"), "spawns children in its own tenant only"),
        (p.SpawnRequest(type="x", code="a" * 64), "code artifact " + "a" * 64),
    ]:
        await spawn_is_refused(broker, worker, request_, message)
    assert {t.tenant for t in broker.node.state.tasks.values()} == {"t"}
    # Its own tenant, stated or not, is fine.
    root = await finish_spawning(broker, worker, p.SpawnRequest(type="x", tenant="t"))
    assert broker.task(root).state == TaskState.FINISHED


async def test_a_worker_id_with_a_final_newline_is_refused(broker: Broker) -> None:
    # NAME_RE ends in "$", which lets a final "\n" through .match (found by fuzzing).
    bad = broker.worker("w1\n")
    await bad.connect()
    bad.send(p.Hello(worker_id="w1\n", task_types={"*": 1}))
    error = await _expect_error_and_close(bad, "bad_handshake")
    assert "worker_id" in error.message
    assert "w1\n" not in broker.node.state.workers
