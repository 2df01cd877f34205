"""The leader puts assignments into submit entries (broker/workers/placement.py, docs/DESIGN.md
§6), against fake workers over real TCP (the harness of tests/unit/test_worker_link.py).

``Broker.submit(placed=True)`` builds the entry as the API's submit handler does. Every wait
is bounded.
"""

from __future__ import annotations

import asyncio

from broker.core import TaskState
from broker.core import entries as e
from broker.replication.node import Stamp
from tests.support.link_broker import Broker
from wire import worker_protocol as p


def placed_in_submits(broker: Broker) -> list[int]:
    return [a.task_id for entry in broker.entries(e.SubmitTasks) for a in entry.assignments]


async def test_a_per_call_submit_with_a_free_slot_needs_no_assignment_entry(
    broker: Broker,
) -> None:
    worker = broker.worker("w1", task_types={"*": 2})
    await worker.hello()
    for n in range(3):
        [task_id] = await broker.submit(placed=True)
        assign = await worker.expect(p.Assign)
        assert [(t.task_id, t.attempt) for t in assign.tasks] == [(task_id, 1)]
        # The log came first: the task is running on w1 when its frame arrives.
        assert broker.task(task_id).state == TaskState.RUNNING
        worker.finish_ok(task_id, 1)
        await worker.expect(p.FinishAck)
        assert broker.task(task_id).state == TaskState.FINISHED, n
    assert broker.entries(e.AssignTasks) == []
    assert len(placed_in_submits(broker)) == 3
    # Two entries per task: its submit and its finish.
    assert len(broker.entries(e.SubmitTasks)) + len(broker.entries(e.FinishTasks)) == 6


async def test_a_stopping_broker_places_nothing_with_a_submit(broker: Broker) -> None:
    # docs/DESIGN.md §6, "Stopping": neither the scheduler nor a submit starts a task.
    worker = broker.worker("w1", task_types={"*": 2})
    await worker.hello()
    broker.link.draining = True
    [task_id] = await broker.submit(placed=True)
    assert placed_in_submits(broker) == []
    assert broker.entries(e.AssignTasks) == []
    assert broker.task(task_id).state == TaskState.WAITING


async def test_a_waiting_queue_is_never_short_cut(broker: Broker) -> None:
    worker = broker.worker("w1", task_types={"*": 1})
    await worker.hello()
    first, second = await broker.submit(2, placed=True)  # the first fits, the second waits
    assert placed_in_submits(broker) == [first]
    assert (await worker.expect(p.Assign)).tasks[0].task_id == first
    [third] = await broker.submit(placed=True)  # second waits: no placement, even later
    assert placed_in_submits(broker) == [first]
    assert broker.task(third).state == TaskState.WAITING
    worker.finish_ok(first, 1)
    # The scheduler takes over, in FIFO order.
    assert (await worker.expect(p.Assign)).tasks[0].task_id == second
    assert [a.task_id for a in broker.entries(e.AssignTasks)[0].assignments] == [second]
    worker.finish_ok(second, 1)
    assert (await worker.expect(p.Assign)).tasks[0].task_id == third


async def test_concurrent_submits_count_placements_in_flight(broker: Broker) -> None:
    worker = broker.worker("w1", task_types={"*": 3})
    await worker.hello()
    results = await asyncio.gather(*(broker.submit(placed=True) for _ in range(10)))
    ids = [task_id for [task_id] in results]
    running = [i for i in ids if broker.task(i).state == TaskState.RUNNING]
    assert len(running) == 3 and len(placed_in_submits(broker)) <= 3  # never beyond capacity
    received: list[int] = []
    while len(received) < 3:
        received += [t.task_id for t in (await worker.expect(p.Assign)).tasks]
    assert sorted(received) == sorted(running)
    await worker.expect_none(p.Assign, within=0.2)
    # Finishing frees slots: the deferred scheduler places the rest, never over capacity.
    done = 0
    while received:
        task_id = received.pop(0)
        worker.finish_ok(task_id, 1)
        done += 1
        if done <= len(ids) - 3:
            received += [t.task_id for t in (await worker.expect(p.Assign)).tasks]
        assert len(broker.node.state.running_by_worker.get("w1", ())) <= 3
    await broker.until(lambda: all(broker.task(i).state == TaskState.FINISHED for i in ids))


async def test_a_placement_apply_refuses_wakes_the_scheduler(broker: Broker) -> None:
    worker = broker.worker("w1", task_types={"*": 1})
    await worker.hello()

    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(id=task_id, type="noop", tenant="t")
        return e.SubmitTasks(
            time_ms=stamp.now_ms, tasks=(spec,), assignments=(e.Assignment(task_id, "ghost"),)
        )

    await broker.node.propose(build)
    [task] = (await worker.expect(p.Assign)).tasks
    assert broker.task(task.task_id).worker == "w1"
    assert len(broker.entries(e.AssignTasks)) == 1
