"""Lost workers (docs/DESIGN.md §6, "Lost workers"): an attempt ended by its worker's death
or by the worker coming back without it is lost, not counted against ``max_attempts``, and
bounded by ``max_lost``; a task's own failures still count (issue 30)."""

from __future__ import annotations

import pytest

from broker.core import ErrorCode, TaskRef, WorkerState
from tests.support.machine import Machine, code


@pytest.fixture
def sm() -> Machine:
    return Machine()


def test_dead_worker_requeues_without_using_an_attempt(sm: Machine) -> None:
    """docs/DESIGN.md §6, "Lost workers": a task of max_attempts 1 survives its worker's
    death; the attempt is lost, not counted, and the task waits again at once."""
    sm.register("w1")
    sm.register("w2")
    task_id = sm.add(max_attempts=1, retry_backoff_ms=60_000)
    assert sm.assign(task_id, "w1") == TaskRef(task_id, "running")
    assert sm.m.tasks[task_id].attempt == 1
    assert sm.worker_dead("w1") is None
    task = sm.m.tasks[task_id]
    # Waiting, not delayed: the backoff is for the task's own failures.
    assert (task.state, task.attempt, task.lost, task.worker) == ("waiting", 1, 1, None)
    assert task.counted_attempts() == 0
    assert task.error is not None and "w1 died" in task.error
    assert sm.m.workers["w1"].state == WorkerState.DEAD
    # A dead worker gets nothing.
    assert code(sm.assign(task_id, "w1")) == ErrorCode.STALE
    assert sm.assign(task_id, "w2") == TaskRef(task_id, "running")
    assert sm.m.tasks[task_id].attempt == 2
    assert sm.finish(sm.outcome(task_id, worker_id="w2", attempt=2)) == [
        TaskRef(task_id, "finished")
    ]
    assert code(sm.worker_dead("nobody")) == ErrorCode.NOT_FOUND
    sm.m.check_invariants()


def test_a_task_that_loses_more_than_max_lost_attempts_fails_saying_so(sm: Machine) -> None:
    sm.register("w1")
    task_id = sm.add(max_attempts=1, max_lost=3)
    for lost in range(1, 5):
        sm.register("w1")  # back (a new registration after its death)
        assert sm.assign(task_id) == TaskRef(task_id, "running")
        sm.worker_dead("w1")
        task = sm.m.tasks[task_id]
        assert (task.lost, task.attempt) == (lost, lost)
        assert task.state == ("waiting" if lost <= 3 else "error")
    assert task.error == "worker w1 died: heartbeat deadline missed (lost 4 times, max_lost 3)"
    assert task.finished_ms == sm.now
    sm.m.check_invariants()


def test_max_lost_0_fails_at_the_first_loss(sm: Machine) -> None:
    sm.register("w1")
    task_id = sm.add(max_attempts=5, max_lost=0)
    sm.assign(task_id)
    sm.register("w1", running=())  # back without it
    task = sm.m.tasks[task_id]
    assert task.state == "error"
    assert task.error == f"worker w1 came back without task {task_id} (lost 1 times, max_lost 0)"


def test_own_failures_still_count_against_max_attempts_beside_lost_ones(sm: Machine) -> None:
    sm.register("w1")
    sm.register("w2")
    task_id = sm.add(max_attempts=2)
    sm.assign(task_id, "w1")
    sm.worker_dead("w1")  # lost: attempt 1 not counted
    sm.assign(task_id, "w2")
    assert sm.finish(sm.outcome(task_id, worker_id="w2", attempt=2, ok=False)) == [
        TaskRef(task_id, "waiting")
    ]
    assert sm.m.tasks[task_id].counted_attempts() == 1
    sm.assign(task_id, "w2")
    assert sm.finish(sm.outcome(task_id, worker_id="w2", attempt=3, ok=False)) == [
        TaskRef(task_id, "error")
    ]
    task = sm.m.tasks[task_id]
    assert (task.attempt, task.lost) == (3, 1)
    assert task.error is not None and "(attempt 2 of 2)" in task.error


def test_an_older_leaders_entries_count_the_lost_attempt(sm: Machine) -> None:
    """A WorkerDead or RegisterWorker logged before format 5 applies the rule it was logged
    under (every replica and a replay agree with that leader): the attempt counts."""
    sm.register("w1")
    dying, returning = sm.add(max_attempts=1), sm.add(max_attempts=1)
    sm.assign(dying)
    sm.worker_dead("w1", v=4)
    sm.register("w1", v=4)
    sm.assign(returning)
    sm.register("w1", running=(), v=4)
    for task_id in (dying, returning):
        task = sm.m.tasks[task_id]
        assert (task.state, task.lost) == ("error", 0)
        assert task.error is not None and "(attempt 1 of 1)" in task.error
