"""Spawned children count against their tenant's max_waiting (issue 14, item 8): a finish
whose children would not all fit fails the spawning attempt with an error naming the limit,
and creates none of them; the limit is read from the state being applied, as every replica
reads it. (Children were always started within max_running: the scheduler counts every
running task of a tenant, spawned or not.)
"""

from __future__ import annotations

from typing import Any

import msgspec

from broker.core import StateMachine, TaskRef, TaskState, TreeState
from broker.core import entries as e
from tests.support.fake_worker import FakeWorker
from tests.support.link_broker import Broker
from tests.support.machine import Machine
from wire import worker_protocol as p

WAITING = TaskState.WAITING.value


class Limits(Machine):
    def __init__(self, machine: StateMachine | None = None) -> None:
        super().__init__(machine)
        self.register("w1")

    def running(self, tenant: str = "t", **fields: Any) -> int:
        task_id = self.add(tenant, **fields)
        assert isinstance(self.assign(task_id), TaskRef)
        return task_id

    def finish_spawning(self, task_id: int, *children: e.TaskSpec) -> str | None:
        """Finish task_id ok, spawning ``children``; its state after."""
        spawn = tuple(e.Spawn(c, (task_id,) if c.track_tree else ()) for c in children)
        outcome = msgspec.structs.replace(self.outcome(task_id), spawn=spawn)
        (result,) = self.finish(outcome)
        assert isinstance(result, TaskRef)
        return self.state(task_id)


def _queue_of(sm: Limits, tenant: str, waiting: int, max_waiting: int) -> None:
    sm.set_tenant(tenant, max_waiting=max_waiting)
    for _ in range(waiting):
        sm.add(tenant)


def test_a_spawn_over_max_waiting_fails_the_attempt_and_creates_no_child() -> None:
    sm = Limits()
    parent = sm.running()
    _queue_of(sm, "t", waiting=2, max_waiting=3)
    before = set(sm.m.tasks)
    children = [sm.spec(), sm.spec()]  # 2 queued + 2 > 3: neither is created
    assert sm.finish_spawning(parent, *children) == TaskState.ERROR.value
    task = sm.m.tasks[parent]
    assert task.error == "spawn refused: tenant 't' max_waiting 3 reached (attempt 1 of 1)"
    assert task.result is None
    assert set(sm.m.tasks) == before
    # The stamped ids are used up all the same.
    assert sm.m.max_task_id >= max(c.id for c in children)
    # Within the limit (children exactly filling the queue) a spawn is created.
    other = sm.running()
    fitting = sm.spec()
    assert sm.finish_spawning(other, fitting) == TaskState.FINISHED.value
    assert sm.state(fitting.id) == WAITING and sm.m.tasks[fitting.id].parent == other
    assert sm.m.queued("t") == 3


def test_a_refused_spawn_is_retried_like_any_failed_attempt() -> None:
    sm = Limits()
    parent = sm.running(max_attempts=2)
    _queue_of(sm, "t", waiting=1, max_waiting=1)
    assert sm.finish_spawning(parent, sm.spec()) == WAITING
    assert sm.m.tasks[parent].error == "spawn refused: tenant 't' max_waiting 1 reached"
    # The parent itself is queued again now; make room for it and its child.
    sm.set_tenant("t", max_waiting=3)
    assert isinstance(sm.assign(parent), TaskRef)
    child = sm.spec()
    assert sm.finish_spawning(parent, child) == TaskState.FINISHED.value
    assert sm.m.tasks[child.id].parent == parent


def test_children_count_against_their_own_tenants_limit() -> None:
    # Without tenant isolation a child may belong to another tenant: its limit applies.
    sm = Limits()
    parent = sm.running("t")
    _queue_of(sm, "u", waiting=1, max_waiting=1)
    assert sm.finish_spawning(parent, sm.spec("t"), sm.spec("u")) == TaskState.ERROR.value
    assert "spawn refused: tenant 'u' max_waiting 1 reached" in (sm.m.tasks[parent].error or "")
    assert sm.m.queued("t") == 0


def test_a_refused_spawn_in_a_tree_fails_the_tree() -> None:
    sm = Limits()
    root = sm.running(track_tree=True)
    _queue_of(sm, "t", waiting=1, max_waiting=1)
    assert sm.finish_spawning(root, sm.spec(track_tree=True)) == TaskState.ERROR.value
    tree = sm.m.tree(root)
    assert tree is not None and tree.state == TreeState.FAILED.value
    assert tree.reason is not None and "ended in error" in tree.reason


def test_the_limit_is_read_at_apply_time_alike_on_every_replica() -> None:
    leader = Limits()
    parent = leader.running(max_attempts=3)
    _queue_of(leader, "t", waiting=1, max_waiting=0)  # unlimited when the child was asked
    follower = Machine(StateMachine.from_snapshot(leader.m.encode_snapshot()))
    child = leader.spec()
    spawn = (e.Spawn(child),)
    entries: list[e.Entry] = [
        e.SetTenant(time_ms=leader.now, tenant="t", limits=e.TenantLimitsPatch(max_waiting=1)),
        e.FinishTasks(
            time_ms=leader.now,
            outcomes=(msgspec.structs.replace(leader.outcome(parent), spawn=spawn),),
        ),
    ]
    for machine in (leader, follower):
        for entry in entries:
            machine.apply(e.decode_entry(e.encode_entry(entry)))
        assert machine.state(parent) == WAITING and child.id not in machine.m.tasks
    assert leader.m.digest() == follower.m.digest()


async def _finish_spawning(worker: FakeWorker, task_id: int, *, children: int) -> None:
    """The worker finishes attempt 1 of ``task_id``, spawning ``children`` untracked
    children, and the broker acknowledges the report."""
    worker.finish(
        p.TaskReport(
            task_id=task_id,
            attempt=1,
            ok=True,
            result=b"1",
            spawn=tuple(p.SpawnRequest(type="child", tracked=False) for _ in range(children)),
        )
    )
    await worker.expect(p.FinishAck)


async def test_a_worker_report_spawning_over_the_limit_fails_the_task(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [parent] = await broker.submit()
    await worker.expect(p.Assign)
    await broker.node.propose(
        lambda stamp: e.SetTenant(
            time_ms=stamp.now_ms, tenant="t", limits=e.TenantLimitsPatch(max_waiting=2)
        )
    )
    await _finish_spawning(worker, parent, children=3)
    task = broker.task(parent)
    assert task.state == TaskState.ERROR
    assert task.error is not None
    assert task.error.startswith("spawn refused: tenant 't' max_waiting 2 reached"), task.error
    assert list(broker.node.state.tasks) == [parent]
    # Within the limit the same report spawns its children.
    [second] = await broker.submit()
    await worker.expect(p.Assign)
    await _finish_spawning(worker, second, children=2)
    assert broker.task(second).state == TaskState.FINISHED
    assert len([t for t in broker.node.state.tasks.values() if t.parent == second]) == 2
