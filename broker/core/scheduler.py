"""The scheduler: which waiting tasks start now, and on which workers.

Pure and deterministic, beside the state machine: ``schedule(state)`` only
reads the state (never a clock or a random source) and returns assignments;
the leader logs them as one ``AssignTasks`` entry and ``apply`` moves the
tasks to running, so the next call sees them running. The same state always
yields the same assignments.

Fair sharing is weighted Dominant Resource Fairness (DRF) across tenants. A
tenant's dominant share is the largest fraction of any cluster resource its
running tasks hold; every task also holds one unit of an implicit "tasks"
resource whose total is the sum of the connected workers' task capacities, so
tasks that ask for no resources share slots by weight. Each step serves the
tenant with the smallest ``dominant share / weight`` (ties by tenant name):
the first task of its queue that fits a worker goes to the fitting worker with
the most free capacity for that task's type (ties by worker id).

Cost per round, with W connected workers, R' running tasks that ask for
resources, T tenants with waiting tasks and A assignments made:

- setup: O(T + R' log R' + workers declaring resources) -- no pass over the
  workers: their free slots come from the state's capacity index (kept across
  rounds, docs/DESIGN.md §8 "Workers at scale"), read in its order (most free
  first, ties by id) and viewed only when looked at; resource usage is summed in
  sorted order so float totals (and so the outcome) do not depend on set
  iteration order;
- each assignment: O(log T) on the tenant heap plus O(log W) on the heap of
  workers looked at for its type (more only when the best workers are refused
  by their tenant filter or resources, bounded by W);
- queues are never scanned: each tenant's queue is read through an iterator (its
  priority levels, highest first, each FIFO: ``state.by_priority``; P distinct
  priorities add O(P log P) per tenant, nothing per queued task), at
  most ``A + lookahead`` entries per tenant per round. Usage only grows during
  a round, so a task that did not fit cannot fit later in the same round: it
  is skipped (it keeps its place in the queue) and so is any later task with
  the same type and asks (memoised).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterator
from typing import Final

from broker.core.entries import Assignment
from broker.core.fit import fits, pool_of, resources_left, within_global_limits
from broker.core.records import Task
from broker.core.state import StateMachine
from broker.core.transitions import TaskState

DEFAULT_MAX_ASSIGNMENTS: Final = 1000
DEFAULT_LOOKAHEAD: Final = 16


class _Pool:
    """Capacity for one task type (or the "*" pool) on one worker."""

    __slots__ = ("free", "worker")

    def __init__(self, worker: _Worker, capacity: int) -> None:
        self.worker = worker
        self.free = capacity  # may go negative if a worker came back smaller


class _Worker:
    __slots__ = ("free", "id", "pools", "tenants")

    def __init__(self, worker_id: str, tenants: list[str], free: dict[str, float]) -> None:
        self.id = worker_id
        self.tenants = frozenset(tenants) if tenants else None  # None: serves everyone
        self.free = free  # resources left after running tasks
        self.pools: dict[str, _Pool] = {}

    def pool_for(self, task_type: str) -> _Pool | None:
        name = pool_of(self.pools, task_type)
        return None if name is None else self.pools[name]


class _Tenant:
    __slots__ = ("name", "queue", "room", "running", "share", "skips_left", "usage", "weight")

    def __init__(self, name: str, queue: Iterator[int], weight: float, lookahead: int) -> None:
        self.name = name
        self.queue = queue  # resumes where the previous step stopped
        self.weight = weight
        self.room: int | None = None  # tasks it may still start (max_running), None: no limit
        self.running = 0
        self.usage: dict[str, float] = {}
        self.share = 0.0  # dominant share
        self.skips_left = lookahead


# A pool in a per-type heap: most free capacity first, then worker id. The
# free count in the key may be stale (higher than the pool's): fixed on peek.
_PoolEntry = tuple[int, str, _Pool]


class _Candidates:
    """The pools one task type may use this round: those looked at (a heap) and the
    rest, still in the capacity index's order. Free counts only fall during a round, so
    a pool not yet looked at is never better than the index's next entry says."""

    __slots__ = ("ahead", "heap", "rest")

    def __init__(self, rest: Iterator[tuple[int, str]]) -> None:
        self.heap: list[_PoolEntry] = []
        self.rest = rest
        self.ahead = next(rest, None)

    def advance(self) -> None:
        self.ahead = next(self.rest, None)


def _queue(levels: dict[int, dict[int, None]]) -> Iterator[int]:
    """A tenant's waiting tasks in scheduling order: higher priority first, FIFO within."""
    if len(levels) == 1:
        return iter(next(iter(levels.values())))
    return itertools.chain.from_iterable(levels[p] for p in sorted(levels, reverse=True))


def schedule(
    state: StateMachine,
    max_assignments: int = DEFAULT_MAX_ASSIGNMENTS,
    lookahead: int = DEFAULT_LOOKAHEAD,
    eligible_workers: Collection[str] | None = None,
) -> list[Assignment]:
    """Assignments for this round, in the order they were decided.

    ``eligible_workers``: when given, only these (connected) workers receive
    tasks, e.g. those with a live connection to this leader.

    ``lookahead``: how many tasks per tenant may be found not to fit (and be
    skipped) in one round before that tenant is passed over until the next
    round; 1 is strict head-of-line FIFO.
    """
    if lookahead < 1:
        raise ValueError("lookahead must be >= 1")
    if max_assignments <= 0 or not state.by_priority:
        # Nothing waits: skip the round's O(workers + running) setup (a round runs after
        # nearly every applied entry, so this is what most of them cost at 10,000 workers).
        return []
    return _Round(state, lookahead, eligible_workers).run(max_assignments)


class _Round:
    def __init__(
        self, state: StateMachine, lookahead: int, eligible: Collection[str] | None = None
    ) -> None:
        self.state = state
        self.tasks = state.tasks
        self.limits = state.config.global_limits
        self.eligible = eligible
        capacity = self.capacity = state.capacity()
        # Views of the workers this round has looked at, made on first look (by id).
        self.views: dict[str, _Worker] = {}
        # Counted over every connected worker (the index's totals): an upper bound of the
        # eligible ones' free slots, and the fair shares' denominator.
        self.free_slots = capacity.free_slots
        self.slots_total = capacity.slots_total
        self.resource_totals: dict[str, float] = {}
        for worker_id in sorted(capacity.resourced):
            for name, amount in state.workers[worker_id].resources.items():
                self.resource_totals[name] = self.resource_totals.get(name, 0.0) + amount
        self.by_type: dict[str, _Candidates] = {}
        # (type, tenant or "", asks) of tasks that did not fit this round.
        self.no_fit: set[tuple[str, str, tuple[tuple[str, float], ...]]] = set()
        # Without tenant filters, a misfit is the same for every tenant.
        self.filtered = bool(capacity.filtered)

        tenants: dict[str, _Tenant] = {}
        counts = state.tenant_counts
        for name, levels in state.by_priority.items():
            if levels:
                limits = state.tenants.get(name)
                weight = limits.weight if limits is not None else 1.0
                view_t = tenants[name] = _Tenant(name, _queue(levels), weight, lookahead)
                view_t.running = counts[name][TaskState.RUNNING] if name in counts else 0
                if limits is not None and limits.max_running > 0:
                    view_t.room = limits.max_running

        # Resource usage of the running tasks that ask for any, summed by worker and task
        # id so float totals (and so the outcome) do not depend on set iteration order.
        global_used = self.global_used = dict.fromkeys(self.limits, 0.0)
        tasks = self.tasks
        for task_id in sorted(capacity.asking, key=lambda i: (tasks[i].worker or "", i)):
            task = tasks[task_id]
            owner = tenants.get(task.tenant)
            for name, amount in task.resources.items():
                if name in global_used:
                    global_used[name] += amount
                if owner is not None:
                    owner.usage[name] = owner.usage.get(name, 0.0) + amount

        self.heap: list[tuple[float, str, _Tenant]] = []
        for view_t in tenants.values():
            if view_t.room is not None:
                view_t.room = max(0, view_t.room - view_t.running)
                if view_t.room == 0:
                    continue  # at (or above, after a lowered limit) its max_running
            view_t.share = self._dominant_share(view_t)
            self.heap.append((view_t.share / view_t.weight, view_t.name, view_t))
        heapq.heapify(self.heap)

    def _view(self, worker_id: str) -> _Worker:
        """The worker as this round sees it: free slots per pool, free resources."""
        view = self.views.get(worker_id)
        if view is not None:
            return view
        worker = self.state.workers[worker_id]
        free: dict[str, float] = {}
        if worker.resources:
            tasks = self.tasks
            running = sorted(self.state.running_by_worker.get(worker_id, ()))
            free = resources_left(worker.resources, (tasks[i] for i in running))
        view = self.views[worker_id] = _Worker(worker_id, worker.tenants, free)
        for pool_name, slots in self.capacity.free[worker_id].items():
            view.pools[pool_name] = _Pool(view, slots)
        return view

    def _dominant_share(self, tenant: _Tenant) -> float:
        share = tenant.running / self.slots_total if self.slots_total else 0.0
        totals = self.resource_totals
        for name, used in tenant.usage.items():
            total = totals.get(name, 0.0)
            if total > 0:
                share = max(share, used / total)
        return share

    # --- the round -------------------------------------------------------------------

    def run(self, max_assignments: int) -> list[Assignment]:
        out: list[Assignment] = []
        heap = self.heap
        while heap and self.free_slots > 0 and len(out) < max_assignments:
            tenant = heap[0][2]
            assignment = self._next_for(tenant)
            if assignment is None:
                heapq.heappop(heap)  # nothing (more) it can start this round
                continue
            out.append(assignment)
            if tenant.room == 0:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (tenant.share / tenant.weight, tenant.name, tenant))
        return out

    def _next_for(self, tenant: _Tenant) -> Assignment | None:
        """Start the first task in the tenant's window that fits somewhere, if any."""
        tasks = self.tasks
        for task_id in tenant.queue:
            task = tasks[task_id]
            pool = self._fit(task)
            if pool is not None:
                self._start(tenant, task, pool)
                return Assignment(task_id, pool.worker.id)
            tenant.skips_left -= 1
            if tenant.skips_left == 0:
                return None
        return None

    def _start(self, tenant: _Tenant, task: Task, pool: _Pool) -> None:
        """Count a task assigned this round against its worker, the limits and its tenant."""
        pool.free -= 1
        self.free_slots -= 1
        if tenant.room is not None:
            tenant.room -= 1
        # Usage only grows in a round, so the new dominant share is the old one
        # or the share of a resource this task adds to.
        tenant.running += 1
        share = max(tenant.share, tenant.running / self.slots_total)
        free = pool.worker.free
        global_used = self.global_used
        totals = self.resource_totals
        usage = tenant.usage
        for name, amount in task.resources.items():
            if name in free:
                free[name] -= amount
            if name in global_used:
                global_used[name] += amount
            used = usage[name] = usage.get(name, 0.0) + amount
            total = totals.get(name, 0.0)
            if total > 0:
                share = max(share, used / total)
        tenant.share = share

    def _fit(self, task: Task) -> _Pool | None:
        """The pool (on the best fitting worker) this task would use, or None."""
        asks = task.resources
        key = (
            task.type,
            task.tenant if self.filtered else "",
            tuple(sorted(asks.items())) if asks else (),
        )
        if key in self.no_fit:
            return None
        pool = self._best_pool(task) if self._within_limits(asks) else None
        if pool is None:
            self.no_fit.add(key)
        return pool

    def _within_limits(self, asks: dict[str, float]) -> bool:
        return not self.limits or within_global_limits(asks, self.limits, self.global_used)

    def _best_pool(self, task: Task) -> _Pool | None:
        candidates = self.by_type.get(task.type)
        if candidates is None:
            candidates = self.by_type[task.type] = _Candidates(self._order(task.type))
        heap = candidates.heap
        refused: list[_PoolEntry] = []
        chosen: _Pool | None = None
        while True:
            ahead = candidates.ahead
            if ahead is not None and (not heap or heap[0][:2] > ahead):
                # The next worker in the index may beat every one looked at so far.
                pool = self._view(ahead[1]).pool_for(task.type)
                assert pool is not None  # the index filed it under this type's pool
                heapq.heappush(heap, (ahead[0], ahead[1], pool))
                candidates.advance()
                continue
            if not heap:
                break
            neg_free, worker_id, pool = heap[0]
            if pool.free <= 0:
                heapq.heappop(heap)  # full for the rest of the round
            elif -neg_free != pool.free:  # stale key: re-file under the current count
                heapq.heapreplace(heap, (-pool.free, worker_id, pool))
            elif self._accepts(pool, task):
                chosen = pool
                break
            else:
                refused.append(heapq.heappop(heap))
        for entry in refused:
            heapq.heappush(heap, entry)
        return chosen

    def _order(self, task_type: str) -> Iterator[tuple[int, str]]:
        """The index's candidates for ``task_type`` that are eligible, best first."""
        merged = self.capacity.candidates(task_type)
        eligible = self.eligible
        if eligible is None:
            return merged
        return (key for key in merged if key[1] in eligible)

    @staticmethod
    def _accepts(pool: _Pool, task: Task) -> bool:
        worker = pool.worker
        return fits(worker.tenants, task.tenant, pool.free, worker.free, task.resources)
