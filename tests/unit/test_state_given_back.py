"""The state machine's given-back attempts: a stopping worker or broker gives a running
attempt back (docs/DESIGN.md §6, "Stopping")."""

from __future__ import annotations

import msgspec
import pytest

from broker.core import TaskRef
from broker.core import entries as e
from tests.support.machine import Machine


@pytest.fixture
def sm() -> Machine:
    return Machine()


def test_given_back_attempt_waits_again_uncounted_and_its_worker_gets_no_more(
    sm: Machine,
) -> None:
    # docs/DESIGN.md §6, "Stopping": a stopping worker or broker gives attempts back.
    sm.register("w1")
    sm.register("w2")
    task_id, other = sm.add(), sm.add()  # max_attempts 1
    sm.assign(task_id, "w1")
    given = msgspec.structs.replace(sm.outcome(task_id, ok=False), released=True)
    entry = e.finish_tasks(sm.now, (given,))
    # Written as format 2, which an older broker stops at instead of applying it wrongly.
    assert entry.v == 2 and e.finish_tasks(sm.now, (sm.outcome(other, ok=False),)).v == 1
    assert sm.apply(entry) == [TaskRef(task_id, "waiting")]
    task = sm.m.tasks[task_id]
    assert (task.state, task.attempt, task.released, task.worker) == ("waiting", 1, 1, None)
    assert task.error == "boom"
    assert sm.m.workers["w1"].task_types == {"*": 0}  # stopping: assigned nothing more
    # Another worker runs it as attempt 2, still within max_attempts 1; a real failure
    # of that attempt is counted and fails it.
    assert sm.assign(task_id, "w2") == TaskRef(task_id, "running")
    assert sm.m.tasks[task_id].attempt == 2
    assert sm.finish(sm.outcome(task_id, ok=False)) == [TaskRef(task_id, "error")]
    assert "attempt 1 of 1" in (sm.m.tasks[task_id].error or "")
    # A released flag on a successful report changes nothing.
    sm.assign(other, "w2")
    ok = msgspec.structs.replace(sm.outcome(other), released=True)
    assert sm.finish(ok) == [TaskRef(other, "finished")]
