"""apply returns its effects as values (broker/core/effects.py, docs/DESIGN.md §2).

What an entry did for the rest of the broker (a task became final, a running task must be
stopped, a tree ended) comes back from ``StateMachine.apply`` in an immutable ``Applied``,
in the order it happened; the same entries give the same effects on every replica, and
reading them or not changes nothing in the state.
"""

from __future__ import annotations

import pytest

from broker.core import StateMachine, StopRunning, TaskRef, TaskState
from broker.core import entries as e
from broker.core.effects import Applied, TaskFinal, TreeEnded
from tests.support.machine import T0, Trees


def _entries() -> list[e.Entry]:
    """A finish, a cancel of a running task and a tree that completes, as logged entries."""
    log: list[e.Entry] = []

    class Recording(StateMachine):
        def apply(self, entry: e.Entry) -> Applied:
            log.append(entry)
            return super().apply(entry)

    recorder = Trees(Recording())
    first = recorder.add()
    recorder.run(first)
    recorder.finish(recorder.outcome(first))
    second = recorder.add()
    recorder.run(second)
    recorder.cancel(second)
    root = recorder.root()
    (child,) = recorder.done(root, recorder.child(root))
    recorder.done(child)
    return log


def test_apply_returns_the_result_and_the_effects_in_order() -> None:
    machine = StateMachine()
    effects = [effect for entry in _entries() for effect in machine.apply(entry).effects]
    finals = [effect for effect in effects if isinstance(effect, TaskFinal)]
    assert [(f.task_id, f.state) for f in finals] == [
        (1, TaskState.FINISHED),
        (2, TaskState.CANCELLED),
        (3, TaskState.FINISHED),
        (4, TaskState.FINISHED),
    ]
    (stop,) = [effect for effect in effects if isinstance(effect, StopRunning)]
    assert (stop.worker_id, stop.task_id, stop.attempt) == ("w1", 2, 1)
    assert [effect for effect in effects if isinstance(effect, TreeEnded)] == [TreeEnded(3)]
    # The tree ends with its last task: after that task's TaskFinal, in the same entry.
    assert effects.index(TreeEnded(3)) == effects.index(finals[3]) + 1


def test_an_entry_without_effects_returns_none_and_its_result() -> None:
    machine = StateMachine()
    applied = machine.apply(
        e.SubmitTasks(time_ms=T0, tasks=[e.TaskSpec(id=1, type="py", tenant="t")])
    )
    assert applied.effects == ()
    assert applied.result == [TaskRef(1, TaskState.WAITING.value)]


def test_every_replica_computes_the_same_effects_and_reading_them_changes_nothing() -> None:
    entries = _entries()
    leader, follower = StateMachine(), StateMachine()
    leader_effects = [leader.apply(entry).effects for entry in entries]
    for entry in entries:
        follower.apply(entry)  # effects ignored, as a replay does
    assert leader.digest() == follower.digest()
    assert leader.encode_snapshot() == follower.encode_snapshot()
    replayed = StateMachine()
    assert [replayed.apply(entry).effects for entry in entries] == leader_effects


def test_applied_is_immutable() -> None:
    applied = StateMachine().apply(e.Tick(time_ms=T0))
    with pytest.raises(AttributeError):
        applied.effects = (TreeEnded(1),)  # type: ignore[misc]
    assert isinstance(applied.effects, tuple)
