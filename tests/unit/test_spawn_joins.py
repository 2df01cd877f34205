"""Joins through the leader's worker endpoint (broker/workers/finish_reports.py): children
anchored to earlier siblings of the same report get their ids when the leader stamps them,
and wait for them; an anchor of another tree fails the spawning task with a clear error;
``ctx.spawn`` answers handles that name earlier children (clients/worker/task_api.py)."""

from __future__ import annotations

import pytest

from broker.core import TaskState
from broker.core import entries as e
from clients.worker.task_api import SpawnedChild, TaskContext
from tests.support.fake_worker import FakeWorker
from tests.support.link_broker import Broker
from wire import worker_protocol as p
from wire.worker_protocol import AssignedTask


async def _finish_spawning(broker: Broker, worker: FakeWorker, *spawn: p.SpawnRequest) -> int:
    [root] = await broker.submit(track_tree=True)
    await worker.expect(p.Assign)
    worker.finish(p.TaskReport(task_id=root, attempt=1, ok=True, spawn=spawn))
    await worker.expect(p.FinishAck)
    return root


async def test_a_join_on_earlier_siblings_waits_for_them(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    root = await _finish_spawning(
        broker,
        worker,
        p.SpawnRequest(type="part"),
        p.SpawnRequest(type="part"),
        p.SpawnRequest(type="combine", anchor_self=False, anchor_spawns=(0, 1)),
    )
    [finish] = broker.entries(e.FinishTasks)
    a, b, join = (s.task.id for s in finish.outcomes[0].spawn)
    assert [s.anchors for s in finish.outcomes[0].spawn] == [(root,), (root,), (a, b)]
    assert finish.v == 3  # a join: an older broker would start it at once
    state = broker.node.state
    assert state.tasks[join].waiting_for == [a, b] and state.tasks[join].root == root
    assigned: set[int] = set()
    while assigned != {a, b}:
        assign = await worker.expect(p.Assign)
        assigned |= {t.task_id for t in assign.tasks}
    assert join not in assigned
    worker.finish_ok(a, 1)
    await worker.expect(p.FinishAck)
    assert state.tasks[join].waiting_for == [b]
    worker.finish_ok(b, 1)
    await worker.expect(p.FinishAck)
    assign = await worker.expect(p.Assign)
    assert [t.task_id for t in assign.tasks] == [join]
    worker.finish_ok(join, 1)
    await worker.expect(p.FinishAck)
    tree = state.tree(root)
    assert tree is not None and tree.state == "completed"


@pytest.mark.parametrize(
    ("spawn", "message"),
    [
        ((p.SpawnRequest(type="x", anchor_spawns=(0,)),), "must name earlier children"),
        (
            (p.SpawnRequest(type="x", tracked=False), p.SpawnRequest(type="y", anchor_spawns=(0,))),
            "anchored to child #0, which is untracked",
        ),
        ((p.SpawnRequest(type="x", tracked=False, anchor_spawns=(0,)),), "takes no anchors"),
    ],
)
async def test_bad_sibling_anchors_fail_the_task(
    broker: Broker, spawn: tuple[p.SpawnRequest, ...], message: str
) -> None:
    worker = broker.worker()
    await worker.hello()
    root = await _finish_spawning(broker, worker, *spawn)
    task = broker.task(root)
    assert task.state == TaskState.ERROR and message in (task.error or ""), task.error


async def test_an_anchor_of_another_tree_fails_the_spawning_task(broker: Broker) -> None:
    worker = broker.worker()
    await worker.hello()
    [other] = await broker.submit(track_tree=True)
    await worker.expect(p.Assign)
    root = await _finish_spawning(broker, worker, p.SpawnRequest(type="x", anchors=(other,)))
    task = broker.task(root)
    assert task.state == TaskState.ERROR
    assert f"anchor {other} is not a task of this task's tree (root {root})" in (task.error or "")


def test_spawn_answers_handles_that_anchor_later_children() -> None:
    task = AssignedTask(task_id=1, attempt=1, type="noop", tenant="a", params=b"")
    ctx = TaskContext(task)
    first = ctx.spawn("part", {"i": 0})
    second = ctx.spawn("part", {"i": 1})
    assert (first, second) == (SpawnedChild(0), SpawnedChild(1))
    ctx.spawn("combine", None, anchors=[first, second, 42])
    combine = ctx.spawned[2]
    assert combine.anchor_spawns == (0, 1) and combine.anchors == (42,)
    assert not combine.anchor_self
    with pytest.raises(ValueError, match="did not spawn"):
        ctx.spawn("x", anchors=[SpawnedChild(7)])
