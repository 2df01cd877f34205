"""The leader's placement of submitted tasks in their own submit entry (docs/DESIGN.md §6).

When a submit entry is being built and no task of any tenant waits, the scheduler would
start the new tasks next anyway, in their order: the leader puts their assignments into
the submit entry itself, so such a task costs two durable entries (submit, finish) instead
of three. :class:`SubmitPlacement` picks the workers as the scheduler would (the connected
worker serving the tenant with the most free capacity for the type, ties by worker id),
counting the placements still in flight (logged, not yet applied). ``apply`` re-checks
everything (broker/core/workers.py): a placement it refuses leaves the task waiting for
the scheduler, which the applied submit wakes.

While placements are in flight the scheduler defers its round (the link asks
:attr:`SubmitPlacement.busy`): a round computed before they are applied would not count
their slots, and ``AssignTasks`` does not re-check capacity. They are applied within one
group commit; the last one released wakes the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from broker.core import entries as e
from broker.core.state import StateMachine, Task, Worker

# A batch's first tasks at most: the rest wait for the scheduler (whose heaps scale).
MAX_PLACED_PER_ENTRY: Final = 64

# As the scheduler's: absorbs float rounding when fractional asks add up to a capacity.
_EPSILON: Final = 1e-9


@dataclass(frozen=True, slots=True)
class _Placed:
    worker_id: str
    pool: str
    tenant: str
    resources: dict[str, float]


class _Room:
    """A worker's free slots per pool and free resources, running and in-flight counted."""

    __slots__ = ("free", "id", "types", "used")

    def __init__(self, worker: Worker, running: list[Task], placed: list[_Placed]) -> None:
        self.id = worker.id
        self.types = worker.task_types
        self.used: dict[str, int] = {}
        self.free = dict(worker.resources)
        for task in running:
            self.take(self.pool(task.type), task.resources)
        for item in placed:
            self.take(item.pool, item.resources)

    def pool(self, task_type: str) -> str:
        # A type listed by name uses its own capacity (even 0), never the "*" pool.
        return task_type if task_type in self.types else "*"

    def slots(self, pool: str) -> int:
        return self.types.get(pool, 0) - self.used.get(pool, 0)

    def fits(self, asks: dict[str, float]) -> bool:
        for name, amount in asks.items():
            left = self.free.get(name)
            if amount > 0 and (left is None or amount > left + _EPSILON):
                return False
        return True

    def take(self, pool: str, resources: dict[str, float]) -> None:
        self.used[pool] = self.used.get(pool, 0) + 1
        for name, amount in resources.items():
            if name in self.free:
                self.free[name] -= amount


class SubmitPlacement:
    """The worker link's :class:`~broker.replication.node.SubmitPlacer`."""

    def __init__(self, state: Callable[[], StateMachine], eligible: Mapping[str, object]) -> None:
        self._state = state
        self._eligible = eligible  # the connected sessions, by worker id
        self._placed: dict[int, _Placed] = {}  # by task id: logged, not yet applied
        self._by_worker: dict[str, dict[int, _Placed]] = {}
        self.deferred = False  # the scheduler skipped a round while busy
        self.paused = False  # the broker is stopping: place nothing (DESIGN §6, "Stopping")
        self.wake: Callable[[], None] = lambda: None

    @property
    def busy(self) -> bool:
        return bool(self._placed)

    def place(self, tasks: Sequence[e.TaskSpec], now_ms: int) -> tuple[e.Assignment, ...]:
        state = self._state()
        if self.paused or not self._eligible or not tasks or state.waiting_count:
            return ()  # a waiting task goes first: the scheduler's fair share decides
        tenant = tasks[0].tenant
        if any(task.tenant != tenant for task in tasks):
            return ()  # several tenants' new tasks: the scheduler's fair share decides
        room = self._tenant_room(state, tenant)
        rooms: dict[str, _Room | None] = {}  # the workers looked at (None: not its tenant's)
        out: list[e.Assignment] = []
        for task in tasks[:MAX_PLACED_PER_ENTRY]:
            if (room is not None and room <= 0) or not self._starts_now(state, task, now_ms):
                break  # FIFO: a later task never starts before this one
            best = self._best(state, rooms, tenant, task)
            if best is None:
                break
            placed = _Placed(best.id, best.pool(task.type), tenant, task.resources)
            best.take(placed.pool, placed.resources)
            self._placed[task.id] = placed
            self._by_worker.setdefault(best.id, {})[task.id] = placed
            out.append(e.Assignment(task.id, best.id))
            if room is not None:
                room -= 1
        return tuple(out)

    def release(self, assignments: tuple[e.Assignment, ...]) -> None:
        for assignment in assignments:
            placed = self._placed.pop(assignment.task_id, None)
            if placed is not None:
                on_worker = self._by_worker.get(placed.worker_id)
                if on_worker is not None:
                    on_worker.pop(assignment.task_id, None)
                    if not on_worker:
                        del self._by_worker[placed.worker_id]
        if not self._placed and self.deferred:
            self.deferred = False
            self.wake()

    def _tenant_room(self, state: StateMachine, tenant: str) -> int | None:
        limits = state.tenants.get(tenant)
        if limits is None or limits.max_running <= 0:
            return None
        running = state.tenant_counts.get(tenant, {}).get("running", 0)
        in_flight = sum(1 for placed in self._placed.values() if placed.tenant == tenant)
        return limits.max_running - running - in_flight

    @staticmethod
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

    def _room(self, state: StateMachine, worker_id: str, tenant: str) -> _Room | None:
        """A worker's room for ``tenant``'s task, in-flight placements counted, or None."""
        if worker_id not in self._eligible:
            return None
        worker = state.workers[worker_id]  # in the capacity index: connected
        if worker.tenants and tenant not in worker.tenants:
            return None
        running = [state.tasks[i] for i in state.running_by_worker.get(worker_id, ())]
        placed = list(self._by_worker.get(worker_id, {}).values())
        return _Room(worker, running, placed)

    def _best(
        self, state: StateMachine, rooms: dict[str, _Room | None], tenant: str, task: e.TaskSpec
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
            else:
                found = rooms[worker_id] = self._room(state, worker_id, tenant)
            if found is None:
                continue
            slots = found.slots(found.pool(task.type))
            if slots <= 0 or not found.fits(task.resources):
                continue
            if best_key is None or (-slots, worker_id) < best_key:
                best, best_key = found, (-slots, worker_id)
        return best
