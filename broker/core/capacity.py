"""The connected workers' free slots (``CapacityIndex``), a derived index of the state
machine (docs/DESIGN.md §2, "The state machine's parts"; §8, "Workers at scale").

Its invariant: equal to a rebuild from the workers and their running tasks.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Iterator, Mapping

from broker.core.fit import ANY_TYPE, pool_of
from broker.core.records import Task, Worker, WorkerState


class CapacityIndex:
    """Free task slots of the connected workers, kept in step with every change
    (derived: built from the state on first use, so a loaded snapshot builds it afresh;
    docs/DESIGN.md §8, "Workers at scale"). Integers only, so the incremental result
    equals a rebuild exactly; the scheduler and the submit placement read it instead of
    visiting every worker per round or per submit.
    """

    __slots__ = (
        "asking",
        "capacity",
        "filtered",
        "free",
        "free_slots",
        "order",
        "resourced",
        "slots_total",
    )

    def __init__(
        self,
        workers: Mapping[str, Worker],
        tasks: Mapping[int, Task],
        running_by_worker: Mapping[str, set[int]],
    ) -> None:
        # Connected worker -> pool ("*" or a type it lists) -> its capacity, and the
        # capacity minus the running tasks in that pool (negative if it came back smaller).
        self.capacity: dict[str, dict[str, int]] = {}
        self.free: dict[str, dict[str, int]] = {}
        # Pool -> (-free, worker id) of the connected workers with room in it, sorted:
        # the scheduler's order (most free first, ties by id).
        self.order: dict[str, list[tuple[int, str]]] = {}
        self.slots_total = 0  # sum of the connected workers' capacities
        self.free_slots = 0  # sum of their free slots (each pool's counted from 0)
        self.resourced: set[str] = set()  # connected workers declaring resources
        self.filtered: set[str] = set()  # connected workers serving only some tenants
        self.asking: set[int] = set()  # running tasks asking for resources
        for worker_id in sorted(workers):  # in order: each insert lands at an end
            self.reindex(workers[worker_id], tasks, running_by_worker.get(worker_id, ()))
        for ids in running_by_worker.values():
            self.asking.update(i for i in ids if tasks[i].resources)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CapacityIndex):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def reindex(self, worker: Worker, tasks: Mapping[int, Task], running: Collection[int]) -> None:
        """A worker's record changed (registered, dead, stopping): file it afresh."""
        wid = worker.id
        old = self.free.pop(wid, None)
        if old is not None:
            for pool, free in old.items():
                self._file(wid, pool, free, 0)
            self.slots_total -= sum(max(0, n) for n in self.capacity.pop(wid).values())
        self.resourced.discard(wid)
        self.filtered.discard(wid)
        if worker.state != WorkerState.CONNECTED:
            return
        self.capacity[wid] = dict(worker.task_types)
        self.slots_total += sum(max(0, n) for n in worker.task_types.values())
        pools = self.free[wid] = dict(worker.task_types)
        for task_id in running:
            used = pool_of(pools, tasks[task_id].type)
            if used is not None:
                pools[used] -= 1
        for pool, free in pools.items():
            self._file(wid, pool, 0, free)
        if worker.resources:
            self.resourced.add(wid)
        if worker.tenants:
            self.filtered.add(wid)

    @property
    def connected_workers(self) -> int:
        """How many workers the state counts as connected."""
        return len(self.capacity)

    def candidates(self, task_type: str) -> Iterator[tuple[int, str]]:
        """(-free, worker id) of the connected workers with room for ``task_type``, best
        first: those listing the type by name merged with the "*" pools of the others
        (the scheduler's order)."""
        sources: list[Iterator[tuple[int, str]]] = []
        named = self.order.get(task_type)
        if named:
            sources.append(iter(named))
        star = self.order.get(ANY_TYPE) if task_type != ANY_TYPE else None
        if star:
            free = self.free
            sources.append(key for key in star if pool_of(free[key[1]], task_type) == ANY_TYPE)
        if len(sources) == 1:
            return sources[0]
        return heapq.merge(*sources)

    def started(self, worker_id: str, task: Task) -> None:
        self._take(worker_id, task, -1)
        if task.resources:
            self.asking.add(task.id)

    def stopped(self, worker_id: str, task: Task) -> None:
        self._take(worker_id, task, 1)
        self.asking.discard(task.id)

    def _take(self, worker_id: str, task: Task, delta: int) -> None:
        pools = self.free.get(worker_id)
        if pools is None:
            return  # not connected: indexed again when it registers
        pool = pool_of(pools, task.type)
        if pool is not None:
            old = pools[pool]
            pools[pool] = old + delta
            self._file(worker_id, pool, old, old + delta)

    def _file(self, worker_id: str, pool: str, old: int, new: int) -> None:
        """Move a pool's entry in the order from ``old`` free slots to ``new``."""
        self.free_slots += max(0, new) - max(0, old)
        order = self.order.get(pool)
        if old > 0 and order is not None:
            del order[bisect.bisect_left(order, (-old, worker_id))]
            if not order:
                del self.order[pool]
        if new > 0:
            bisect.insort(self.order.setdefault(pool, []), (-new, worker_id))
