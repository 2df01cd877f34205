"""The state machine's shared state and task bookkeeping, under the subject mixins.

``MachineBase`` declares every attribute the subject mixins (tasks, transactions, trees,
workers, tenants, code artifacts) share, and keeps the derived indexes in step with each
task: adding, moving (through the transition table only) and deleting a task, its
queues, slots and timers. ``StateMachine`` (broker/core/state.py) combines the mixins;
see docs/DESIGN.md §2.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Mapping
from enum import IntEnum

from broker.core.effects import Effect, TaskFinal
from broker.core.fit import ANY_TYPE, pool_of
from broker.core.records import (
    FINAL_STATES,
    LIVE_STATES,
    QUEUED_STATES,
    ApiToken,
    Artifact,
    Config,
    StopRunning,
    SubmissionRecord,
    Task,
    Tenant,
    Transaction,
    TreeRecord,
    TreeState,
    Worker,
    WorkerState,
)
from broker.core.transitions import TaskState, check_move


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


class _Timer(IntEnum):
    # Order in which timers due at the same millisecond fire.
    TXN_EXPIRE = 0
    START = 1
    DEADLINE = 2
    PURGE = 3
    TREE_DEADLINE = 4


class MachineBase:
    """Shared state of the state machine and the bookkeeping every subject uses."""

    def __init__(self) -> None:
        self.now_ms = 0
        self.max_task_id = 0
        self.max_transaction_id = 0
        self.config = Config()
        self.tasks: dict[int, Task] = {}
        self.tenants: dict[str, Tenant] = {}
        self.transactions: dict[int, Transaction] = {}
        self.workers: dict[str, Worker] = {}
        self.artifacts: dict[str, Artifact] = {}
        # Per-tenant FIFO of waiting task ids (a dict used as an ordered set).
        self.waiting: dict[str, dict[int, None]] = {}
        # How many tasks those queues hold (derived): "does any task wait?" in O(1), not
        # O(tenants) (a tenant's emptied queue stays in ``waiting``).
        self.waiting_count = 0
        # The same tasks by tenant and priority, each level in the order of the queue
        # above (derived): the scheduler reads the highest level first, so its cost does
        # not depend on how many lower-priority tasks wait (docs/DESIGN.md §6).
        self.by_priority: dict[str, dict[int, dict[int, None]]] = {}
        # Waiting tasks whose code artifact is not ready, by artifact: kept out of the
        # queues above so the scheduler never even looks at them (derived, like below).
        self.parked: dict[str, dict[int, None]] = {}
        # (scope, idempotency key) -> the first submission's result, oldest first (so
        # expiry only looks at the front); the scope is the tenant (idempotency_scope).
        self.idempotency: OrderedDict[tuple[str, str], SubmissionRecord] = OrderedDict()
        # Tracked trees by root id; a record lives as long as its root task.
        self.trees: dict[int, TreeRecord] = {}
        # API tokens by id, and their ids by secret hash (derived).
        self.tokens: dict[str, ApiToken] = {}
        self.token_ids_by_hash: dict[str, str] = {}
        # Derived indexes, rebuilt on snapshot load. Slots by (tenant, slot name).
        self.slots: dict[tuple[str, str], int] = {}
        self.by_state: dict[str, set[int]] = {s.value: set() for s in TaskState}
        self.tenant_counts: dict[str, dict[str, int]] = {}
        self.running_by_worker: dict[str, set[int]] = {}
        # Live tasks of each tracked tree (root id -> ids): a failed tree's outstanding
        # tasks are cancelled without scanning every task.
        self.tree_live: dict[int, set[int]] = {}
        # Every task of each tracked tree, final ones too (root id -> ids): the tree view
        # counts them by state without scanning every task (GET /api/v1/trees/{root}).
        self.tree_members: dict[int, set[int]] = {}
        # Live tasks waiting for each unfinished dependency (dependency id -> dependant
        # ids): a finish releases its dependants without any scan, and blocked tasks stay
        # out of the run queues (docs/DESIGN.md §2, "Dependencies"). Derived.
        self.dependants: dict[int, dict[int, None]] = {}
        self._timers: list[tuple[int, int, int]] = []  # (due_ms, kind, id)
        # Free slots of the connected workers (derived, built on first use: see
        # ``capacity``).
        self._capacity: CapacityIndex | None = None
        self.entries_applied = 0
        # Each webhook's outbox (tenant -> (event key, task id), in log order): the events
        # not yet logged as delivered, so any broker that loads this state delivers them,
        # whatever it replayed (docs/API.md, Webhooks). Only tenants with a webhook.
        self.webhook_outbox: dict[str, deque[tuple[tuple[int, int, int], int]]] = {}
        # The task type names workers ever listed, by the tenant they serve ("" for workers
        # serving every tenant), first listed first; and the tenants ("" too) over the cap,
        # whose submits are no longer checked (broker/core/served_types.py).
        self.served_types: dict[str, dict[str, None]] = {}
        self.served_types_full: set[str] = set()
        # The log position of the entry being applied (the applier sets it): the first two
        # parts of the outbox's event keys. Not state: every replica applies each entry at
        # the same position.
        self.position: tuple[int, int] = (-1, -1)
        # The effects of the entry being applied, returned by apply (broker.core.effects);
        # not state.
        self._effects: list[Effect] = []

    def capacity(self) -> CapacityIndex:
        """The connected workers' free slots, as the scheduler reads them."""
        if self._capacity is None:
            self._capacity = CapacityIndex(self.workers, self.tasks, self.running_by_worker)
        return self._capacity

    def _worker_changed(self, worker: Worker) -> None:
        """A worker's record changed (state, capacities, resources, tenants)."""
        if self._capacity is not None:
            self._capacity.reindex(worker, self.tasks, self.running_by_worker.get(worker.id, ()))

    def _check_capacity(self) -> str | None:
        """What differs between the capacity index and a rebuild (the invariants)."""
        built = self.capacity()  # built now if no reader has asked yet: kept from here on
        fresh = CapacityIndex(self.workers, self.tasks, self.running_by_worker)
        if fresh == built:
            return None
        return "capacity index differs from a rebuild"

    def _push_timer(self, due_ms: int, kind: _Timer, ident: int) -> None:
        heapq.heappush(self._timers, (due_ms, int(kind), ident))

    def _push_task_timers(self, task: Task) -> None:
        if task.state == TaskState.DELAYED and task.start_after_ms is not None:
            self._push_timer(task.start_after_ms, _Timer.START, task.id)
        if task.state in LIVE_STATES and task.deadline_ms is not None:
            self._push_timer(task.deadline_ms, _Timer.DEADLINE, task.id)
        if task.state in FINAL_STATES and task.finished_ms is not None:
            self._push_timer(self._purge_ms(task), _Timer.PURGE, task.id)

    def _push_tree_timers(self) -> None:
        for tree in self.trees.values():
            if tree.state == TreeState.PENDING and tree.deadline_ms is not None:
                self._push_timer(tree.deadline_ms, _Timer.TREE_DEADLINE, tree.root)

    def _rebuild_timers(self) -> None:
        self._timers = []
        for task in self.tasks.values():
            self._push_task_timers(task)
        for txn in self.transactions.values():
            self._push_timer(txn.expires_ms, _Timer.TXN_EXPIRE, txn.id)
        self._push_tree_timers()

    def _counts(self, tenant: str) -> dict[str, int]:
        counts = self.tenant_counts.get(tenant)
        if counts is None:
            counts = self.tenant_counts[tenant] = {s.value: 0 for s in TaskState}
        return counts

    def _add_task(self, task: Task) -> None:
        self.tasks[task.id] = task
        self.by_state[task.state].add(task.id)
        self._counts(task.tenant)[task.state] += 1
        if task.slot is not None and task.state in LIVE_STATES:
            self.slots[(task.tenant, task.slot)] = task.id
        if task.state == TaskState.WAITING:
            self._enqueue(task)
        elif task.state == TaskState.RUNNING and task.worker is not None:
            self.running_by_worker.setdefault(task.worker, set()).add(task.id)
            if self._capacity is not None:
                self._capacity.started(task.worker, task)
        if task.root is not None and task.state in LIVE_STATES:
            self.tree_live.setdefault(task.root, set()).add(task.id)
        if task.root is not None:
            self.tree_members.setdefault(task.root, set()).add(task.id)
        if task.waiting_for and task.state in LIVE_STATES:
            for dependency in task.waiting_for:
                self.dependants.setdefault(dependency, {})[task.id] = None
        self._push_task_timers(task)

    def _code_blocked(self, task: Task) -> bool:
        """Whether the task's code artifact is not ready (then it may not be scheduled)."""
        code = task.code
        if code is None:
            return False
        artifact = self.artifacts.get(code)
        return artifact is not None and not artifact.ready

    def _enqueue(self, task: Task) -> None:
        """File a task that became waiting: in its tenant's queue, or parked on its code;
        nowhere while it waits for dependencies (``dependants`` holds it)."""
        if task.waiting_for:
            return
        if task.code is not None and self._code_blocked(task):
            self.parked.setdefault(task.code, {})[task.id] = None
        else:
            self._queue(task)

    def _queue(self, task: Task) -> None:
        """Append a waiting task to its tenant's queue and to its priority's level."""
        self.waiting.setdefault(task.tenant, {})[task.id] = None
        self.waiting_count += 1
        self.by_priority.setdefault(task.tenant, {}).setdefault(task.priority, {})[task.id] = None

    def _priority_levels(self) -> dict[str, dict[int, dict[int, None]]]:
        """``by_priority`` as derived from the queues' order (snapshot load, checks)."""
        out: dict[str, dict[int, dict[int, None]]] = {}
        tasks = self.tasks
        for tenant, queue in self.waiting.items():
            for task_id in queue:
                levels = out.setdefault(tenant, {})
                levels.setdefault(tasks[task_id].priority, {})[task_id] = None
        return out

    def queue_head(self, tenant: str) -> int | None:
        """The task the scheduler would consider first for ``tenant``, or None."""
        levels = self.by_priority.get(tenant)
        if not levels:
            return None
        return next(iter(levels[max(levels)]))

    def _dequeue(self, task: Task) -> None:
        # Readiness only goes from False to True, and readying releases every parked
        # task at once: a waiting task is parked exactly while its code is blocked.
        if task.waiting_for:
            return  # blocked: in no queue
        if task.code is not None and self._code_blocked(task):
            parked = self.parked[task.code]
            del parked[task.id]
            if not parked:
                del self.parked[task.code]
        else:
            del self.waiting[task.tenant][task.id]
            self.waiting_count -= 1
            levels = self.by_priority[task.tenant]
            level = levels[task.priority]
            del level[task.id]
            if not level:
                del levels[task.priority]
                if not levels:
                    del self.by_priority[task.tenant]

    def _purge_ms(self, task: Task) -> int:
        """When a final task is deleted; a root not before its tree's end + retention."""
        assert task.finished_ms is not None
        done_ms = task.finished_ms
        if task.root == task.id:
            tree = self.trees.get(task.id)
            if tree is not None and tree.ended_ms is not None:
                done_ms = max(done_ms, tree.ended_ms)
        return done_ms + self.config.finished_task_retention_ms

    def _move(self, task: Task, new: TaskState) -> None:
        old = task.state
        if old == new:
            return
        check_move(old, new)  # an illegal move is a bug: apply is deterministic
        self.by_state[old].discard(task.id)
        self.by_state[new].add(task.id)
        counts = self._counts(task.tenant)
        counts[old] -= 1
        counts[new] += 1
        if old == TaskState.WAITING:
            self._dequeue(task)
        elif old == TaskState.RUNNING and task.worker is not None:
            self.running_by_worker[task.worker].discard(task.id)
            if self._capacity is not None:
                self._capacity.stopped(task.worker, task)
        elif old == TaskState.PENDING and task.transaction is not None:
            # Leaving a transaction other than by its commit (which pops it first).
            txn = self.transactions.get(task.transaction)
            if txn is not None:
                txn.task_ids.remove(task.id)
        if new == TaskState.WAITING:
            self._enqueue(task)
            task.worker = None
        elif new == TaskState.RUNNING and task.worker is not None:
            self.running_by_worker.setdefault(task.worker, set()).add(task.id)
            if self._capacity is not None:
                self._capacity.started(task.worker, task)
        if task.root is not None and (old in FINAL_STATES) != (new in FINAL_STATES):
            if new in FINAL_STATES:
                self._untrack_live(task)
            else:  # a root replayed
                self.tree_live.setdefault(task.root, set()).add(task.id)
        task.state = new
        task.updated_ms = self.now_ms
        if new in FINAL_STATES:
            if task.slot is not None and self.slots.get((task.tenant, task.slot)) == task.id:
                del self.slots[(task.tenant, task.slot)]
            self._effects.append(TaskFinal(task.id, new))
            task.finished_ms = self.now_ms
            if task.code is not None and (artifact := self.artifacts.get(task.code)):
                artifact.last_used_ms = self.now_ms  # code retention counts from here
            self._push_timer(
                self.now_ms + self.config.finished_task_retention_ms, _Timer.PURGE, task.id
            )
            if task.waiting_for:
                self._unlink_dependencies(task)
            if task.id in self.dependants:
                self._dependency_ended(task)

    def _delete_task(self, task: Task) -> None:
        check_move(task.state, None)
        del self.tasks[task.id]
        self.by_state[task.state].discard(task.id)
        self._counts(task.tenant)[task.state] -= 1
        if task.state == TaskState.WAITING:
            self._dequeue(task)
        elif task.state == TaskState.RUNNING and task.worker is not None:
            self.running_by_worker[task.worker].discard(task.id)
            if self._capacity is not None:
                self._capacity.stopped(task.worker, task)
        if task.slot is not None and self.slots.get((task.tenant, task.slot)) == task.id:
            del self.slots[(task.tenant, task.slot)]
        if task.root is not None and task.state in LIVE_STATES:
            self._untrack_live(task)
        if task.root is not None:
            members = self.tree_members[task.root]
            members.discard(task.id)
            if not members:
                del self.tree_members[task.root]
        if task.waiting_for and task.state in LIVE_STATES:
            self._unlink_dependencies(task)
        if task.root == task.id:
            self.trees.pop(task.id, None)

    def _unlink_dependencies(self, task: Task) -> None:
        """A blocked task ended or was deleted: its dependencies no longer wait on it."""
        for dependency in task.waiting_for:
            waiting = self.dependants.get(dependency)
            if waiting is not None:
                waiting.pop(task.id, None)
                if not waiting:
                    del self.dependants[dependency]
        task.waiting_for = []

    def _dependency_ended(self, task: Task) -> None:
        """``task``, a dependency of others, reached a final state (DependenciesMixin)."""

    def _untrack_live(self, task: Task) -> None:
        assert task.root is not None
        live = self.tree_live[task.root]
        live.discard(task.id)
        if not live:
            del self.tree_live[task.root]

    def _tenant(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name=name)
            self._counts(name)
        return tenant

    def _queued(self, tenant: str) -> int:
        counts = self._counts(tenant)
        return sum(counts[s] for s in QUEUED_STATES)

    def _stop_if_running(self, task: Task, reason: str) -> None:
        if task.state == TaskState.RUNNING and task.worker is not None:
            self._effects.append(StopRunning(task.worker, task.id, task.attempt, reason))
