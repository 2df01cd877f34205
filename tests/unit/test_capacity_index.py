"""The connected workers' free slots kept across rounds (broker/core/capacity.py's
``CapacityIndex``, docs/DESIGN.md §8 "Workers at scale"): in step with every entry that
changes a worker, equal to a rebuild (also after a snapshot round trip), and read so that
a scheduling round or a submit's placement looks only at the workers it may use, not at
every connected one.
"""

from __future__ import annotations

import random
from typing import Any, Final

from broker.core import Rejected, StateMachine, TaskRef, TaskState, Worker
from broker.core import entries as e
from broker.core.scheduler import schedule
from broker.workers.placement import SubmitPlacement

T0: Final = 1_700_000_000_000


class CountingWorkers(dict[str, Worker]):
    """``state.workers`` that counts the records read by key."""

    reads = 0

    def __getitem__(self, key: str) -> Worker:
        self.reads += 1
        return super().__getitem__(key)


class Machine:
    def __init__(self, check: bool = True) -> None:
        self.check = check  # check_invariants after each entry (reads every worker)
        self.m = StateMachine()
        self.now = T0
        self.next_id = 0

    def apply(self, entry: e.Entry) -> Any:
        self.now += 1
        result = self.m.apply(entry).result
        if self.check:
            self.m.check_invariants()  # compares the capacity index with a rebuild
        return result

    def worker(self, worker_id: str, **kwargs: Any) -> None:
        entry = e.RegisterWorker(time_ms=self.now, worker_id=worker_id, **kwargs)
        assert not isinstance(self.m.apply(entry).result, Rejected)

    def specs(self, count: int, tenant: str = "t", type: str = "py") -> list[e.TaskSpec]:
        out = []
        for _ in range(count):
            self.next_id += 1
            out.append(e.TaskSpec(id=self.next_id, type=type, tenant=tenant, params=b"null"))
        return out

    def submit(self, count: int, **kwargs: Any) -> list[int]:
        specs = self.specs(count, **kwargs)
        results = self.apply(e.SubmitTasks(time_ms=self.now, tasks=tuple(specs)))
        assert all(isinstance(r, TaskRef) for r in results), results
        return [s.id for s in specs]

    def round(self) -> list[e.Assignment]:
        assignments = schedule(self.m)
        if assignments:
            results = self.apply(e.AssignTasks(time_ms=self.now, assignments=tuple(assignments)))
            assert not [r for r in results if isinstance(r, Rejected)], results
        return assignments


def test_the_index_follows_every_entry_that_changes_a_worker_and_equals_a_rebuild() -> None:
    rng = random.Random(7)
    c = Machine()
    c.m.capacity()  # built from the start: every change below goes through it
    types = [{"*": 2}, {"py": 1, "*": 1}, {"spark": 2}, {"py": 0, "*": 3}, {"*": 0}]
    for step in range(400):
        action = rng.random()
        worker_id = f"w{rng.randrange(8)}"
        if action < 0.15:
            c.apply(
                e.RegisterWorker(
                    time_ms=c.now,
                    worker_id=worker_id,
                    task_types=rng.choice(types),
                    resources=rng.choice([{}, {"cpu": 2.0}]),
                    tenants=rng.choice([(), ("a",)]),
                )
            )
        elif action < 0.22 and worker_id in c.m.workers:
            c.apply(e.WorkerDead(time_ms=c.now, worker_id=worker_id))
        elif action < 0.5:
            specs = c.specs(rng.randrange(1, 4), tenant=rng.choice("ab"))
            specs = [
                e.TaskSpec(
                    id=s.id,
                    type=rng.choice(["py", "spark", "sh"]),
                    tenant=s.tenant,
                    params=b"null",
                    resources=rng.choice([{}, {"cpu": 1.0}]),
                )
                for s in specs
            ]
            c.apply(e.SubmitTasks(time_ms=c.now, tasks=tuple(specs)))
        elif action < 0.8:
            c.round()
        else:
            running = sorted(c.m.by_state[TaskState.RUNNING])
            if running:
                task = c.m.tasks[rng.choice(running)]
                # Given back (released) now and then: the worker then takes nothing more.
                released = rng.random() < 0.2
                outcome = e.TaskOutcome(
                    task.id, task.worker or "", task.attempt, ok=not released, released=released
                )
                c.apply(e.FinishTasks(time_ms=c.now, outcomes=(outcome,)))
        if step % 50 == 0:
            loaded = StateMachine.from_snapshot(c.m.encode_snapshot())
            assert loaded.capacity() == c.m.capacity()
            assert schedule(loaded) == schedule(c.m)


def test_a_round_reads_only_the_workers_it_assigns_to() -> None:
    c = Machine(check=False)
    for n in range(2000):
        c.worker(f"w{n:04d}", task_types={"*": 1})
    c.m.capacity()  # built once, as on a leader's first round
    c.m.workers = CountingWorkers(c.m.workers)
    c.submit(3)
    before = c.m.workers.reads
    assignments = c.round()
    # The three workers first in the index's order (most free, then id), each read once
    # by the round (the apply of its AssignTasks reads them too).
    assert [a.worker_id for a in assignments] == ["w0000", "w0001", "w0002"]
    assert c.m.workers.reads - before <= 3 * 2


def test_a_submit_is_placed_as_before_with_placements_in_flight() -> None:
    c = Machine(check=False)
    for n in range(300):
        c.worker(f"w{n:03d}", task_types={"*": 3 if n % 7 == 0 else 1})
    c.m.capacity()
    c.m.workers = CountingWorkers(c.m.workers)
    sessions = dict.fromkeys(c.m.workers)
    placement = SubmitPlacement(lambda: c.m, sessions)
    first = placement.place(c.specs(10), c.now)
    second = placement.place(c.specs(10), c.now)  # the first batch still in flight
    # Most free slots first, ties by id: the 3-slot workers (every 7th), one task each;
    # the second batch counts the first, still in flight (the index does not yet).
    got = [a.worker_id for a in first + second]
    big = [f"w{n:03d}" for n in range(0, 300, 7)]
    assert got[:10] == [w for w in big[:10]]
    assert got[10:] == [w for w in big[10:20]]
    assert len(set(got)) == 20
    assert c.m.workers.reads < 100  # not every connected worker per submit


def test_a_worker_serving_other_tenants_is_passed_over_without_a_scan_of_all() -> None:
    c = Machine()
    c.worker("a-only", task_types={"*": 5}, tenants=("a",))
    for n in range(50):
        c.worker(f"w{n:02d}", task_types={"*": 1})
    c.submit(1, tenant="b")
    [assignment] = c.round()
    assert assignment.worker_id == "w00"
    c.submit(1, tenant="a")
    [assignment] = c.round()
    assert assignment.worker_id == "a-only"
