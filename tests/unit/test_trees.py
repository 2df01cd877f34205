"""Task trees (Storm's acker) in the state machine: ack vals, failure, timeout, replay.

Scenarios drive ``tests.support.machine.Trees`` (invariants checked after each entry,
including that a pending tree's ack val is the XOR over its live tasks).
"""

from __future__ import annotations

from typing import Any

from broker.core import (
    StateMachine,
    StopRunning,
    TaskRef,
    TaskState,
    TreeState,
    tree_value,
)
from broker.core import entries as e
from tests.support.machine import Trees

FINISHED = TaskState.FINISHED.value
WAITING = TaskState.WAITING.value
CANCELLED = TaskState.CANCELLED.value
PENDING = TreeState.PENDING.value
COMPLETED = TreeState.COMPLETED.value
FAILED = TreeState.FAILED.value


def test_tree_value_is_deterministic_and_spread() -> None:
    assert tree_value(1) == 0x910A2DEC89025CC1  # splitmix64, not Python's hash
    values = {tree_value(i) for i in range(1, 10_000)}
    assert len(values) == 9_999 and 0 not in values


def test_untracked_by_default_and_old_entries_unchanged() -> None:
    m = Trees()
    task = m.add()
    assert m.m.tree(task) is None and m.m.tasks[task].root is None
    spec = e.TaskSpec(id=9, type="py", tenant="t")
    # omit_defaults: an entry without trees encodes exactly as before the feature.
    assert b"track_tree" not in e.encode_entry(e.SubmitTasks(time_ms=1, tasks=(spec,)))
    outcome = e.TaskOutcome(task_id=1, worker_id="w", attempt=1, ok=True)
    assert b"spawn" not in e.encode_entry(e.FinishTasks(time_ms=1, outcomes=(outcome,)))


def test_completes_exactly_when_the_last_task_finishes() -> None:
    m = Trees()
    root = m.root()
    assert m.tree(root).state == PENDING and m.tree(root).ack_val == tree_value(root)
    a, b = m.done(root, m.child(root), m.child(root))
    assert m.tree(root).state == PENDING
    (c,) = m.done(a, m.child(a))
    assert m.tree(root).state == PENDING
    m.done(b)
    assert m.tree(root).state == PENDING  # c still outstanding
    m.done(c)
    assert m.tree(root).state == COMPLETED and m.tree(root).ack_val == 0
    assert m.drain_tree_effects() == [root]
    assert m.m.tasks[c].root == root and m.m.tasks[c].parent == a


def test_a_root_alone_completes_with_its_finish() -> None:
    m = Trees()
    root = m.root()
    m.done(root)
    assert m.tree(root).state == COMPLETED


def test_dag_with_two_anchors() -> None:
    m = Trees()
    root = m.root()
    a, b = m.done(root, m.child(root), m.child(root))
    # a's finish spawns the combiner anchored to a and b (b still running): one node.
    m.run(b)
    (combine,) = m.done(a, m.child(a, b))
    assert m.m.tasks[combine].root == root
    m.done(b)
    assert m.tree(root).state == PENDING
    m.done(combine)
    assert m.tree(root).state == COMPLETED


def test_anchor_outside_the_tree_fails_the_tree() -> None:
    m = Trees()
    other = m.add()
    root = m.root()
    m.done(root, m.child(root, other))
    tree = m.tree(root)
    # max_attempts 1: no replay left.
    assert tree.state == FAILED and "outside the tree" in (tree.reason or "")


def test_unanchored_spawn_is_not_tracked() -> None:
    m = Trees()
    root = m.root()
    free, tracked = m.done(root, m.child(), m.child(root))
    assert m.m.tasks[free].root is None and m.m.tasks[free].parent == root
    m.done(tracked)
    assert m.tree(root).state == COMPLETED
    assert m.state(free) == WAITING  # untouched by its parent's tree
    # Spawned by an untracked task, anchors are a no-op.
    (grandchild,) = m.done(free, m.child(free))
    assert m.m.tasks[grandchild].root is None


def test_failure_fails_at_once_and_replays() -> None:
    m = Trees()
    root = m.root(max_attempts=3)
    a, b = m.done(root, m.child(root), m.child(root))
    m.run(b)
    m.fail(a)  # a has max_attempts 1: in error for good
    assert m.state(a) == TaskState.ERROR.value
    assert m.state(b) == CANCELLED  # outstanding tasks cancelled, the running one stopped
    _, stops = m.drain_effects()
    assert [s.task_id for s in stops] == [b] and isinstance(stops[0], StopRunning)
    tree = m.tree(root)
    assert tree.state == PENDING and tree.attempt == 2 and tree.reason == f"task {a} ended in error"
    assert tree.ack_val == tree_value(root)
    assert m.state(root) == WAITING and m.m.tasks[root].result is None
    assert m.drain_tree_effects() == []  # not over: replayed
    # The replayed run completes on its own.
    (c,) = m.done(root, m.child(root))
    assert m.m.tasks[root].attempt == 2
    m.done(c)
    assert m.tree(root).state == COMPLETED and m.tree(root).reason is None
    assert m.drain_tree_effects() == [root]


def test_failure_without_attempts_left_fails_for_good() -> None:
    m = Trees()
    root = m.root(max_attempts=1)
    (a,) = m.done(root, m.child(root, max_attempts=2))
    m.fail(a)
    assert m.state(a) == WAITING and m.tree(root).state == PENDING  # a retry, not an end
    m.cancel(a)
    tree = m.tree(root)
    assert tree.state == FAILED and tree.reason == f"task {a} was cancelled"
    assert m.state(root) == FINISHED
    assert m.drain_tree_effects() == [root]


def test_timeout_fails_and_replays() -> None:
    m = Trees()
    root = m.root(max_attempts=2, tree_timeout_ms=1_000)
    (a,) = m.done(root, m.child(root))
    m.run(a)
    m.tick(999)
    assert m.tree(root).state == PENDING
    m.tick(1)
    tree = m.tree(root)
    assert tree.attempt == 2 and tree.reason == "tree timed out"
    assert m.state(a) == CANCELLED and m.state(root) == WAITING
    assert tree.deadline_ms is None  # the next run's timeout starts when the root runs
    m.tick(5_000)
    assert tree.state == PENDING
    m.run(root)
    assert tree.deadline_ms == m.now + 1_000
    m.tick(1_000)  # the second run times out too, with the root running: no attempt left
    assert m.tree(root).state == FAILED and m.state(root) == CANCELLED
    _, stops = m.drain_effects()
    assert [(s.task_id, s.attempt) for s in stops] == [(a, 1), (root, 2)]


def test_crashed_parent_spawns_nothing() -> None:
    m = Trees()
    root = m.root(max_attempts=2)
    m.run(root)
    spawn = (m.child(root),)
    m.worker_dead("w1")  # the report comes too late: stale, creates nothing
    late = e.TaskOutcome(task_id=root, worker_id="w1", attempt=1, ok=True, spawn=spawn)
    (result,) = m.finish(late)
    assert not isinstance(result, TaskRef)
    assert spawn[0].task.id not in m.m.tasks and m.m.max_task_id >= spawn[0].task.id
    assert m.tree(root).ack_val == tree_value(root)


def test_purge_of_a_root_waits_for_its_tree() -> None:
    m = Trees()
    m.apply(e.SetConfig(time_ms=m.now, finished_task_retention_ms=10))
    root = m.root()
    (a,) = m.done(root, m.child(root))
    m.tick(100)
    assert root in m.m.tasks  # finished long ago, but its tree is pending
    m.done(a)
    m.tick(100)
    assert root not in m.m.tasks and m.m.tree(root) is None


def test_snapshot_round_trip_mid_tree() -> None:
    m = Trees()
    root = m.root(max_attempts=2, tree_timeout_ms=5_000)
    a, _ = m.done(root, m.child(root), m.child(root))
    data = m.m.encode_snapshot()
    loaded = StateMachine.from_snapshot(data)
    loaded.check_invariants()
    assert loaded.encode_snapshot() == data and loaded.digest() == m.m.digest()
    copy = Trees(loaded)
    copy.now = m.now
    for machine in (m, copy):
        machine.done(a)
    assert copy.tree(root).state == PENDING
    for machine in (m, copy):
        machine.tick(5_000)  # the timer was rebuilt from the snapshot
    assert copy.tree(root).attempt == m.tree(root).attempt == 2
    assert copy.m.digest() == m.m.digest()


class Logged(Trees):
    """Keeps every entry applied, encoded, as the leader's log."""

    def __init__(self) -> None:
        self.log: list[bytes] = []
        super().__init__()

    def apply(self, entry: e.Entry) -> Any:
        self.log.append(e.encode_entry(entry))
        return super().apply(entry)


def test_digest_equal_on_a_replica() -> None:
    leader = Logged()
    root = leader.root(max_attempts=3)
    a, _ = leader.done(root, leader.child(root), leader.child(root))
    leader.done(a, leader.child(a), leader.child())
    leader.tick(40_000)  # timeout and replay
    (c,) = leader.done(root, leader.child(root))
    leader.done(c)
    assert leader.tree(root).state == COMPLETED and leader.tree(root).attempt == 2
    follower = StateMachine()
    for data in leader.log:
        follower.apply(e.decode_entry(data))
    follower.check_invariants()
    assert follower.digest() == leader.m.digest()
    assert follower.trees == leader.m.trees
