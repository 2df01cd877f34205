"""Task dependencies in the state machine: ``after`` on submit, and joins (a spawned child
anchored to several tasks of its tree waits for them). Invariants (the dependants index,
blocked tasks outside the queues) are checked after every entry by ``Machine``."""

from __future__ import annotations

from broker.core import ErrorCode, StateMachine, TaskRef, TaskState, TreeState
from broker.core import entries as e
from tests.support.machine import Trees, code

WAITING = TaskState.WAITING.value
RUNNING = TaskState.RUNNING.value
FINISHED = TaskState.FINISHED.value
ERROR = TaskState.ERROR.value
CANCELLED = TaskState.CANCELLED.value


def test_a_dependant_waits_outside_the_queues_until_all_finished() -> None:
    m = Trees()
    a, b = m.add(), m.add()
    dependant = m.add(after=(a, b))
    task = m.m.tasks[dependant]
    assert task.state == WAITING and task.after == [a, b] and task.waiting_for == [a, b]
    assert m.waiting() == [a, b]  # not queued: the scheduler never sees it
    assert m.m.dependants == {a: {dependant: None}, b: {dependant: None}}
    assert code(m.assign(dependant)) == ErrorCode.STALE
    m.done(a)
    assert task.waiting_for == [b] and m.waiting() == [b]
    m.done(b)
    assert task.waiting_for == [] and task.after == [a, b]
    assert m.waiting() == [dependant] and m.m.dependants == {}
    m.done(dependant)
    assert m.state(dependant) == FINISHED


def test_a_finished_dependency_counts_at_once() -> None:
    m = Trees()
    a = m.add()
    m.done(a)
    dependant = m.add(after=(a,))
    assert m.m.tasks[dependant].waiting_for == [] and m.waiting() == [dependant]


def test_a_failed_or_cancelled_dependency_fails_the_dependant_and_cascades() -> None:
    m = Trees()
    a, b = m.add(), m.add()
    first = m.add(after=(a,))
    second = m.add(after=(first,))  # a chain: fails with its predecessor
    other = m.add(after=(b,))
    m.fail(a)
    assert m.state(first) == ERROR and m.m.tasks[first].error == f"dependency {a} failed"
    assert m.state(second) == ERROR and m.m.tasks[second].error == f"dependency {first} failed"
    assert m.m.tasks[first].waiting_for == []  # a final task waits for nothing
    assert isinstance(m.cancel(b), TaskRef)
    assert m.m.tasks[other].error == f"dependency {b} was cancelled"
    assert m.m.dependants == {} and m.waiting() == []


def test_after_is_checked_at_submit() -> None:
    m = Trees()
    mine, theirs = m.add(), m.add(tenant="other")
    failed = m.add()
    m.fail(failed)
    assert code(m.submit_one(after=(999,))) == ErrorCode.NOT_FOUND
    # Another tenant's task is "not found" too.
    assert code(m.submit_one(after=(theirs,))) == ErrorCode.NOT_FOUND
    assert code(m.submit_one(after=(failed,))) == ErrorCode.CONFLICT
    assert code(m.submit_one(after=(mine, mine))) == ErrorCode.INVALID  # validate_task_spec
    assert code(m.submit_one(after=tuple(range(1, 102)))) == ErrorCode.INVALID
    txn = m.begin()
    pending = m.add(transaction=txn)
    assert code(m.submit_one(after=(pending,))) == ErrorCode.INVALID
    assert m.m.dependants == {}


def test_a_cancelled_dependant_leaves_the_index_and_a_delayed_one_waits_too() -> None:
    m = Trees()
    a = m.add()
    cancelled = m.add(after=(a,))
    delayed = m.add(after=(a,), start_after_ms=m.now + 1_000)
    assert isinstance(m.cancel(cancelled), TaskRef)
    assert m.m.dependants == {a: {delayed: None}}
    m.tick(2_000)
    assert m.state(delayed) == WAITING and m.waiting() == [a]  # started, still blocked
    m.done(a)
    assert m.waiting() == [delayed]


def test_a_dependant_in_a_transaction_is_released_after_its_commit() -> None:
    m = Trees()
    a = m.add()
    txn = m.begin()
    dependant = m.add(transaction=txn, after=(a,))
    m.done(a)
    assert m.state(dependant) == TaskState.PENDING.value
    m.apply(e.CommitTransaction(time_ms=m.now, transaction_id=txn))
    assert m.waiting() == [dependant]


def test_blocked_tasks_survive_a_snapshot() -> None:
    m = Trees()
    a = m.add()
    dependant = m.add(after=(a,))
    reloaded = Trees(StateMachine.from_snapshot(m.m.encode_snapshot()))
    reloaded.m.check_invariants()
    assert reloaded.m.dependants == {a: {dependant: None}} and reloaded.waiting() == [a]
    assert reloaded.m.digest() == m.m.digest()
    reloaded.done(a)
    assert reloaded.waiting() == [dependant]


def test_join_waits_for_every_anchor_and_completes_the_tree_after_it() -> None:
    m = Trees()
    root = m.root()
    # The root spawns two branches and a join anchored to both (a fan-in).
    a, b = m.child(root), m.child(root)
    join = m.child(a.task.id, b.task.id)
    ids = m.done(root, a, b, join)
    joined = ids[2]
    task = m.m.tasks[joined]
    assert task.root == root and task.parent == root
    assert task.waiting_for == [ids[0], ids[1]] and m.waiting() == ids[:2]
    m.done(ids[0])
    assert m.waiting() == [ids[1]]
    m.done(ids[1])
    assert m.waiting() == [joined] and m.tree(root).state == TreeState.PENDING
    m.done(joined)
    assert m.tree(root).state == TreeState.COMPLETED


def test_a_failed_anchor_fails_the_tree_and_cancels_the_join() -> None:
    m = Trees()
    root = m.root()
    a, b = m.child(root), m.child(root)
    ids = m.done(root, a, b, m.child(a.task.id, b.task.id))
    m.fail(ids[0])
    tree = m.tree(root)
    assert tree.state == TreeState.FAILED and f"task {ids[0]} ended in error" in (tree.reason or "")
    assert m.state(ids[2]) == CANCELLED and m.state(ids[1]) == CANCELLED
    assert m.m.dependants == {}


def test_an_anchor_of_another_tree_fails_the_tree_with_its_name() -> None:
    m = Trees()
    other = m.root()
    root = m.root()
    m.done(root, m.child(root, other))
    reason = m.tree(root).reason or ""
    assert f"to task {other}, outside the tree of root {root}" in reason


def test_entries_with_dependencies_need_format_3() -> None:
    plain = e.TaskSpec(id=1, type="py", tenant="t")
    assert e.submit_version((plain,)) == e.BASE_ENTRY_FORMAT_VERSION
    assert e.submit_version((plain, e.TaskSpec(id=2, type="py", tenant="t", after=(1,)))) == 3
    child = e.TaskSpec(id=3, type="py", tenant="t")
    alone = e.TaskOutcome(
        task_id=1, worker_id="w", attempt=1, ok=True, spawn=(e.Spawn(child, (1,)),)
    )
    joined = e.TaskOutcome(
        task_id=1, worker_id="w", attempt=1, ok=True, spawn=(e.Spawn(child, (1, 2)),)
    )
    assert e.finish_tasks(1, (alone,)).v == e.BASE_ENTRY_FORMAT_VERSION
    assert e.finish_tasks(1, (joined,)).v == 3
