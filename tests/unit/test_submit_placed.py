"""Assignments carried by a SubmitTasks entry (broker/core/workers.py, docs/DESIGN.md §6).

``apply`` starts a placed task only if no task waited before the entry, the task is one
this entry created and the head of its tenant's queue, and it fits its worker as the
scheduler counts (connected, serves the tenant, pool capacity, resources, the tenant's
max_running, global limits); otherwise the task waits. Invariants run after every entry.
"""

from __future__ import annotations

from typing import Any

from broker.core import ReplayedResults, StateMachine, TaskRef, TaskState
from broker.core import entries as e
from broker.core.effects import TaskAssigned
from tests.support.machine import Machine


def register(sm: Machine, worker_id: str = "w1", **fields: Any) -> None:
    fields.setdefault("task_types", {"*": 1})
    sm.apply(e.RegisterWorker(time_ms=sm.now, worker_id=worker_id, **fields))


def submit_placed(
    sm: Machine, *specs: e.TaskSpec, to: str = "w1", key: str | None = None
) -> list[TaskRef]:
    entry = e.SubmitTasks(
        time_ms=sm.now,
        tasks=specs,
        idempotency_key=key,
        assignments=tuple(e.Assignment(spec.id, to) for spec in specs),
    )
    result = sm.apply(entry)
    assert isinstance(result, list)
    assert all(isinstance(r, TaskRef) for r in result), result
    return [r for r in result if isinstance(r, TaskRef)]


def started(sm: Machine) -> list[tuple[int, str, int]]:
    return [(a.task_id, a.worker_id, a.attempt) for a in sm.effects if isinstance(a, TaskAssigned)]


def test_a_placed_task_starts_on_a_worker_with_room() -> None:
    sm = Machine()
    register(sm, task_types={"*": 2})
    [ref] = submit_placed(sm, sm.spec())
    task = sm.m.tasks[ref.id]
    assert (task.state, task.worker, task.attempt) == (TaskState.RUNNING, "w1", 1)
    assert ref.state == TaskState.WAITING  # the submit's own answer: created waiting
    assert started(sm) == [(ref.id, "w1", 1)]
    assert sm.m.waiting["t"] == {}


def test_a_batch_starts_only_what_fits_and_the_rest_waits_in_order() -> None:
    sm = Machine()
    register(sm, task_types={"*": 2})
    refs = submit_placed(sm, sm.spec(), sm.spec(), sm.spec())
    assert [sm.state(r.id) for r in refs] == ["running", "running", "waiting"]
    assert sm.waiting() == [refs[2].id]


def test_no_room_unknown_dead_or_wrong_tenant_worker_leaves_the_task_waiting() -> None:
    sm = Machine()
    register(sm, "full", task_types={"*": 1})
    register(sm, "other", task_types={"*": 1}, tenants=("x",))
    register(sm, "dead", task_types={"*": 1})
    sm.apply(e.WorkerDead(time_ms=sm.now, worker_id="dead"))
    busy = sm.add()
    sm.assign(busy, "full")
    for worker in ("full", "ghost", "dead", "other"):
        [ref] = submit_placed(sm, sm.spec(), to=worker)
        assert sm.state(ref.id) == "waiting", worker
        sm.cancel(ref.id)  # queue empty again for the next case
    assert started(sm) == [(busy, "full", 1)]


def test_named_type_pool_resources_and_tenant_limit_are_counted() -> None:
    sm = Machine()
    register(sm, task_types={"*": 4, "gpu": 1}, resources={"cpu": 2.0})
    [gpu] = submit_placed(sm, sm.spec(type="gpu"))
    [gpu2] = submit_placed(sm, sm.spec(type="gpu"))  # its own pool (1) is full
    assert (sm.state(gpu.id), sm.state(gpu2.id)) == ("running", "waiting")
    sm.cancel(gpu2.id)
    [big] = submit_placed(sm, sm.spec(resources={"cpu": 1.5}))
    assert sm.state(big.id) == "running"
    # 1.5 + 1.0 cpu > 2; a resource the worker lacks; each alone in the queue.
    for asks in ({"cpu": 1.0}, {"disk": 1.0}):
        [ref] = submit_placed(sm, sm.spec(resources=asks))
        assert sm.state(ref.id) == "waiting", asks
        sm.cancel(ref.id)
    [small] = submit_placed(sm, sm.spec(resources={"cpu": 0.5}))
    assert sm.state(small.id) == "running"


def test_tenant_max_running_and_global_limits_hold() -> None:
    sm = Machine()
    register(sm, task_types={"*": 4}, resources={"lic": 4.0})
    sm.set_tenant("t", max_running=1)
    refs = submit_placed(sm, sm.spec(), sm.spec())
    assert [sm.state(r.id) for r in refs] == ["running", "waiting"]
    sm.cancel(refs[1].id)
    sm.apply(e.SetConfig(time_ms=sm.now, global_limits={"lic": 1.0}))
    [other] = submit_placed(sm, sm.spec("u", resources={"lic": 1.0}))
    [over] = submit_placed(sm, sm.spec("v", resources={"lic": 1.0}))
    assert (sm.state(other.id), sm.state(over.id)) == ("running", "waiting")


def test_a_waiting_queue_or_a_task_not_at_the_head_is_never_started() -> None:
    sm = Machine()
    register(sm, task_types={"*": 4})
    earlier = sm.add("other")  # waiting before the entry: the scheduler decides
    [ref] = submit_placed(sm, sm.spec())
    assert (sm.state(earlier), sm.state(ref.id)) == ("waiting", "waiting")
    sm.cancel(earlier)
    sm.cancel(ref.id)
    # Placed out of order: the second task is not its queue's head when its turn comes.
    first, second = sm.spec(), sm.spec()
    entry = e.SubmitTasks(
        time_ms=sm.now, tasks=(first, second), assignments=(e.Assignment(second.id, "w1"),)
    )
    sm.apply(entry)
    assert (sm.state(first.id), sm.state(second.id)) == ("waiting", "waiting")


def test_only_tasks_the_entry_created_start() -> None:
    sm = Machine()
    register(sm, task_types={"*": 4})
    [ref] = submit_placed(sm, sm.spec(), key="k1")
    sm.cancel(ref.id)
    # A retry with the same key replays; its placement (of an id it never creates) is moot.
    retry = sm.spec()
    result = sm.apply(
        e.SubmitTasks(
            time_ms=sm.now,
            tasks=(retry,),
            idempotency_key="k1",
            assignments=(e.Assignment(retry.id, "w1"),),
        )
    )
    assert isinstance(result, ReplayedResults) and retry.id not in sm.m.tasks
    # A placement naming a task of another entry does nothing.
    other = sm.add()
    sm.cancel(other)
    delayed = sm.spec(start_after_ms=sm.now + 60_000)
    sm.apply(
        e.SubmitTasks(
            time_ms=sm.now,
            tasks=(delayed,),
            assignments=(e.Assignment(other, "w1"), e.Assignment(delayed.id, "w1")),
        )
    )
    assert (sm.state(other), sm.state(delayed.id)) == ("cancelled", "delayed")
    assert len(started(sm)) == 1


def test_old_entries_decode_without_assignments_and_replicas_agree() -> None:
    sm = Machine()
    register(sm, task_types={"*": 1})
    plain = e.SubmitTasks(time_ms=sm.now, tasks=(sm.spec(),))
    data = e.encode_entry(plain)
    assert b"assignments" not in data  # omitted when empty: the old format, byte for byte
    assert e.decode_entry(data) == plain
    placed = e.SubmitTasks(
        time_ms=sm.now, tasks=(sm.spec(),), assignments=(e.Assignment(sm.next_id, "w1"),)
    )
    follower = StateMachine.from_snapshot(sm.m.encode_snapshot())
    sm.apply(placed)
    follower.apply(e.decode_entry(e.encode_entry(placed)))
    assert follower.digest() == sm.m.digest()
    reloaded = StateMachine.from_snapshot(sm.m.encode_snapshot())
    assert reloaded.tasks[sm.next_id].state == TaskState.RUNNING
