"""Where the new tasks of a submit start, decided while the leader builds its entry
(docs/DESIGN.md §6, "Assignment in the submit's own entry").

When no task of any tenant waits, the scheduler would start the new tasks next anyway, in
their order: the leader puts their assignments into the submit entry itself, so such a
task costs two durable entries (submit, finish) instead of three. :func:`place_new_tasks`
picks the workers as the scheduler would (the connected worker serving the tenant with
the most free capacity for the type, ties by worker id), by the fit rule
(broker/core/fit.py), counting the placements the caller still has in flight (logged, not
yet applied: broker/workers/placement.py keeps them). ``apply`` re-checks everything
(broker/core/workers.py): a placement it refuses leaves the task waiting for the
scheduler. Pure: reads the state and its arguments only.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Final

from broker.core import entries as e
from broker.core.fit import fits, pool_of, resources_left
from broker.core.records import Worker
from broker.core.state import StateMachine

# A batch's first tasks at most: the rest wait for the scheduler (whose heaps scale).
MAX_PLACED_PER_ENTRY: Final = 64


@dataclass(frozen=True, slots=True)
class Placement:
    """A new task placed on a worker, in the pool its type uses there."""

    task_id: int
    worker_id: str
    pool: str
    tenant: str
    resources: dict[str, float]


class _Room:
    """A worker's free slots per pool and free resources, running and in-flight counted."""

    __slots__ = ("free", "id", "tenants", "types", "used")

    def __init__(self, worker: Worker, state: StateMachine, in_flight: Sequence[Placement]) -> None:
        self.id = worker.id
        self.tenants = worker.tenants
        self.types = worker.task_types
        self.used: dict[str, int] = {}
        running = [state.tasks[i] for i in sorted(state.running_by_worker.get(worker.id, ()))]
        self.free = resources_left(worker.resources, running)
        for task in running:
            pool = pool_of(self.types, task.type)
            if pool is not None:
                self.used[pool] = self.used.get(pool, 0) + 1
        for item in in_flight:
            self.take(item.pool, item.resources)

    def slots(self, pool: str) -> int:
        return self.types.get(pool, 0) - self.used.get(pool, 0)

    def take(self, pool: str, resources: dict[str, float]) -> None:
        self.used[pool] = self.used.get(pool, 0) + 1
        for name, amount in resources.items():
            if name in self.free:
                self.free[name] -= amount


def place_new_tasks(
    state: StateMachine,
    tasks: Sequence[e.TaskSpec],
    now_ms: int,
    eligible: Container[str],
    in_flight: Callable[[str], Sequence[Placement]],
    tenant_in_flight: int,
) -> list[Placement]:
    """Placements for the first of ``tasks`` (all of one tenant; none if any task of any
    tenant waits), in order, stopping at the first that would not start now.

    ``eligible``: the workers that may receive tasks (those connected to this leader);
    ``in_flight(worker_id)``: the placements on that worker logged, not yet applied;
    ``tenant_in_flight``: how many of those are the tenant's (counted in its max_running).
    """
    if not tasks or state.waiting_count:
        return []  # a waiting task goes first: the scheduler's fair share decides
    tenant = tasks[0].tenant
    if any(task.tenant != tenant for task in tasks):
        return []  # several tenants' new tasks: the scheduler's fair share decides
    room = _tenant_room(state, tenant, tenant_in_flight)
    rooms: dict[str, _Room | None] = {}  # the workers looked at (None: may not use)
    out: list[Placement] = []
    for task in tasks[:MAX_PLACED_PER_ENTRY]:
        if (room is not None and room <= 0) or not _starts_now(state, task, now_ms):
            break  # FIFO: a later task never starts before this one
        best = _best(state, rooms, eligible, in_flight, task)
        if best is None:
            break
        pool = pool_of(best.types, task.type)
        assert pool is not None  # the index filed the worker under this type's pool
        placed = Placement(task.id, best.id, pool, tenant, task.resources)
        best.take(pool, placed.resources)
        out.append(placed)
        if room is not None:
            room -= 1
    return out


def _tenant_room(state: StateMachine, tenant: str, in_flight: int) -> int | None:
    limits = state.tenants.get(tenant)
    if limits is None or limits.max_running <= 0:
        return None
    running = state.tenant_counts.get(tenant, {}).get("running", 0)
    return limits.max_running - running - in_flight


def _starts_now(state: StateMachine, task: e.TaskSpec, now_ms: int) -> bool:
    """Would apply queue this task as waiting (not pending, delayed or parked)? Tasks
    asking for a globally limited resource are left to the scheduler."""
    if task.transaction is not None:
        return False
    if task.start_after_ms is not None and task.start_after_ms > now_ms:
        return False
    if task.code is not None:
        artifact = state.artifacts.get(task.code)
        if artifact is None or not artifact.ready:
            return False
    limits = state.config.global_limits
    return not any(amount > 0 and name in limits for name, amount in task.resources.items())


def _best(
    state: StateMachine,
    rooms: dict[str, _Room | None],
    eligible: Container[str],
    in_flight: Callable[[str], Sequence[Placement]],
    task: e.TaskSpec,
) -> _Room | None:
    """The fitting worker with the most free slots for the type, ties by worker id.

    Read in the capacity index's order (docs/DESIGN.md §8, "Workers at scale"), which
    counts running tasks but not placements in flight: those only lower a worker's
    count, so once the index's next worker has no more slots than the best found,
    no later one can beat it."""
    best: _Room | None = None
    best_key: tuple[int, str] | None = None
    for key in state.capacity().candidates(task.type):
        if best_key is not None and key > best_key:
            break
        worker_id = key[1]
        if worker_id in rooms:
            found = rooms[worker_id]
        elif worker_id in eligible:
            worker = state.workers[worker_id]  # in the capacity index: connected
            found = rooms[worker_id] = _Room(worker, state, in_flight(worker_id))
        else:
            found = rooms[worker_id] = None
        if found is None:
            continue
        pool = pool_of(found.types, task.type)
        slots = 0 if pool is None else found.slots(pool)
        if not fits(found.tenants, task.tenant, slots, found.free, task.resources):
            continue
        if best_key is None or (-slots, worker_id) < best_key:
            best, best_key = found, (-slots, worker_id)
    return best
