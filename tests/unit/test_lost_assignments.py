"""Lost assignments (docs/DESIGN.md §6, "Lost assignments"): an attempt assigned to a
worker process that comes back without it, neither running it nor holding its report,
never reached it. It waits again without using up an attempt; a restarted process (or an
older worker, whose Hello does not list its unacknowledged reports) proves nothing, and
the attempt counts as before."""

from __future__ import annotations

import pytest

from broker.core import Rejected, TaskRef, TaskState, WorkerReconciled
from broker.core import entries as e
from tests.support.link_broker import Broker
from tests.support.machine import Machine
from wire import worker_protocol as p


def _register(sm: Machine, process_id: str, running: tuple[e.TaskAttempt, ...] = ()) -> None:
    result = sm.apply(
        e.RegisterWorker(time_ms=sm.now, worker_id="w1", process_id=process_id, running=running)
    )
    assert isinstance(result, WorkerReconciled), result


def test_only_the_same_process_proves_an_attempt_never_reached_it() -> None:
    sm = Machine()
    _register(sm, "proc-1")
    held, finished_unacked, lost = (sm.add() for _ in range(3))  # max_attempts 1
    for task_id in (held, finished_unacked, lost):
        sm.assign(task_id)
    listed = (e.TaskAttempt(held, 1), e.TaskAttempt(finished_unacked, 1))
    m = sm.m
    assert m.unreceived_attempts("w1", "proc-1", None, listed) == (e.TaskAttempt(lost, 1),)
    # Another process, another credential, no process id: nothing is proved.
    assert m.unreceived_attempts("w1", "proc-2", None, listed) == ()
    assert m.unreceived_attempts("w1", "proc-1", "cred-x", listed) == ()
    assert m.unreceived_attempts("w2", "proc-1", None, listed) == ()
    # The leader gives it back, then registers the worker: it waits again, uncounted.
    given = e.TaskOutcome(task_id=lost, worker_id="w1", attempt=1, ok=False, released=True)
    assert sm.apply(e.finish_tasks(sm.now, (given,))) == [TaskRef(lost, "waiting")]
    _register(sm, "proc-1", listed)
    task = m.tasks[lost]
    assert (task.state, task.attempt, task.released, task.counted_attempts()) == (
        TaskState.WAITING,
        1,
        1,
        0,
    )
    assert [sm.state(i) for i in (held, finished_unacked)] == ["running", "running"]
    # Its next attempt is number 2 (a stale report of attempt 1 stays fenced) and runs.
    assert sm.assign(lost) == TaskRef(lost, "running")
    assert m.tasks[lost].attempt == 2
    stale = e.TaskOutcome(task_id=lost, worker_id="w1", attempt=1, ok=True, result=b"1")
    assert isinstance(sm.finish(stale)[0], Rejected)
    assert sm.finish(sm.outcome(lost)) == [TaskRef(lost, "finished")]
    m.check_invariants()


async def _assigned_then_lost(broker: Broker, lists_unacked: bool) -> int:
    """w1 (process proc-1) is assigned a task (max_attempts 1), drops the connection
    without starting it and comes back as the same process listing nothing."""
    worker = broker.worker("w1", process_id="proc-1")
    await worker.hello(lists_unacked=True)
    [task_id] = await broker.submit(max_attempts=1)
    await worker.expect(p.Assign)  # as if lost on the way: never started
    await worker.close()
    again = broker.worker("w1", process_id="proc-1")
    await again.hello(running=[], lists_unacked=lists_unacked)
    return task_id


async def test_an_assignment_that_never_reached_its_worker_runs_without_using_an_attempt(
    broker: Broker,
) -> None:
    task_id = await _assigned_then_lost(broker, lists_unacked=True)
    again = broker.workers[-1]
    assert [(t.task_id, t.attempt) for t in (await again.expect(p.Assign)).tasks] == [(task_id, 2)]
    again.finish_ok(task_id, 2, b"7")
    await again.expect(p.FinishAck)
    task = broker.task(task_id)
    assert (task.state, task.result, task.released) == (TaskState.FINISHED, b"7", 1)
    [given_back] = broker.entries(e.FinishTasks)[0].outcomes
    assert given_back.released and "never reached worker w1" in (given_back.error or "")


@pytest.mark.parametrize("why", ["older worker", "restarted"])
async def test_without_proof_the_attempt_is_lost_not_given_back(broker: Broker, why: str) -> None:
    if why == "older worker":
        task_id = await _assigned_then_lost(broker, lists_unacked=False)
    else:
        worker = broker.worker("w1", process_id="proc-1")
        await worker.hello(lists_unacked=True)
        [task_id] = await broker.submit(max_attempts=1)
        await worker.expect(p.Assign)
        await worker.close()
        await broker.worker("w1", process_id="proc-2").hello(lists_unacked=True)
    # Not given back (nothing proves the assignment never arrived): lost with the worker's
    # connection or process, which max_attempts does not count either, but max_lost bounds
    # (docs/DESIGN.md §6, "Lost workers").
    again = broker.workers[-1]
    assert [(t.task_id, t.attempt) for t in (await again.expect(p.Assign)).tasks] == [(task_id, 2)]
    task = broker.task(task_id)
    assert (task.state, task.lost, task.released) == (TaskState.RUNNING, 1, 0)
    assert "came back without" in (task.error or "")
    assert broker.entries(e.FinishTasks) == []
