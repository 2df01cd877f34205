"""The state machine's indexes over its tasks, each a part with one owner and one invariant
(docs/DESIGN.md §2, "The state machine's parts").

Every index here is derived from the records (tasks, artifacts, ...) or, for the run
queues' order and the idempotency keys, is itself state kept in the snapshot; each says
what it must equal (``check``: None, or what differs). ``Books`` (broker/core/books.py)
keeps them in step with every task it adds, moves or deletes; ``check_invariants``
(broker/core/state.py) runs each check, and the simulation runs those after its steps.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from enum import IntEnum

from broker.core.records import (
    LIVE_STATES,
    ApiToken,
    SubmissionRecord,
    Task,
)
from broker.core.transitions import TaskState
from broker.core.validation import validate_idempotency_key

# Tenant -> priority -> the ids at that priority, in the queue's order.
PriorityLevels = dict[str, dict[int, dict[int, None]]]


class TaskQueues:
    """The waiting tasks the scheduler may start: per tenant in FIFO order (``waiting``, a
    dict used as an ordered set; its order is state, kept in the snapshot), the same by
    tenant and priority (``by_priority``, derived: the scheduler reads the highest level
    first, docs/DESIGN.md §6) and how many (``waiting_count``, derived: "does any task
    wait?" in O(1), since a tenant's emptied queue stays in ``waiting``); and the waiting
    tasks whose code artifact is not ready (``parked``, by artifact: kept out of the queues
    so the scheduler never looks at them).

    Invariant: the levels and the count equal a rebuild from the queues; each queued task
    is waiting, of its queue's tenant and free to run; each parked one waits on its code.
    """

    __slots__ = ("by_priority", "parked", "waiting", "waiting_count")

    def __init__(self) -> None:
        self.waiting: dict[str, dict[int, None]] = {}
        self.waiting_count = 0
        self.by_priority: PriorityLevels = {}
        self.parked: dict[str, dict[int, None]] = {}

    def restore_order(self, waiting: Mapping[str, Iterable[int]]) -> None:
        """A snapshot's queue order, set before its tasks are added (``queue`` keeps it)."""
        self.waiting = {name: dict.fromkeys(ids) for name, ids in waiting.items()}

    def queue(self, task: Task) -> None:
        """Append a waiting task to its tenant's queue and to its priority's level."""
        self.waiting.setdefault(task.tenant, {})[task.id] = None
        self.waiting_count += 1
        self.by_priority.setdefault(task.tenant, {}).setdefault(task.priority, {})[task.id] = None

    def unqueue(self, task: Task) -> None:
        del self.waiting[task.tenant][task.id]
        self.waiting_count -= 1
        levels = self.by_priority[task.tenant]
        level = levels[task.priority]
        del level[task.id]
        if not level:
            del levels[task.priority]
            if not levels:
                del self.by_priority[task.tenant]

    def park(self, task: Task, code: str) -> None:
        self.parked.setdefault(code, {})[task.id] = None

    def unpark(self, task: Task, code: str) -> None:
        parked = self.parked[code]
        del parked[task.id]
        if not parked:
            del self.parked[code]

    def unpark_all(self, code: str) -> list[int]:
        """The tasks parked on ``code``, in id order, no longer parked (its code is ready)."""
        return sorted(self.parked.pop(code, None) or ())

    def head(self, tenant: str) -> int | None:
        """The task the scheduler would consider first for ``tenant``, or None."""
        levels = self.by_priority.get(tenant)
        if not levels:
            return None
        return next(iter(levels[max(levels)]))

    def levels_rebuilt(self, tasks: Mapping[int, Task]) -> PriorityLevels:
        """``by_priority`` as derived from the queues' order."""
        out: PriorityLevels = {}
        for tenant, queue in self.waiting.items():
            for task_id in queue:
                levels = out.setdefault(tenant, {})
                levels.setdefault(tasks[task_id].priority, {})[task_id] = None
        return out

    def rebuild_levels(self, tasks: Mapping[int, Task]) -> None:
        self.by_priority = self.levels_rebuilt(tasks)

    def __len__(self) -> int:
        """How many tasks the queues and the parking hold."""
        return self.waiting_count + sum(len(p) for p in self.parked.values())

    def check(
        self,
        tasks: Mapping[int, Task],
        code_blocked: Callable[[Task], bool],
        artifact_ready: Callable[[str], bool | None],
    ) -> str | None:
        """What differs from the invariant (``artifact_ready``: None for an unknown one)."""
        for tenant, queue in self.waiting.items():
            for task_id in queue:
                queued = tasks.get(task_id)
                if queued is None or queued.state != TaskState.WAITING or queued.tenant != tenant:
                    return f"waiting queue of {tenant!r} holds task {task_id} wrongly"
                if code_blocked(queued):
                    return f"task {task_id} is queued though its code is not ready"
                if queued.waiting_for:
                    return f"task {task_id} is queued though it waits for dependencies"
        for sha256, parked in self.parked.items():
            if artifact_ready(sha256) is not False or not parked:
                return f"tasks parked on artifact {sha256} that is unknown, ready or empty"
            for task_id in parked:
                held = tasks.get(task_id)
                if held is None or held.state != TaskState.WAITING or held.code != sha256:
                    return f"task {task_id} is parked on artifact {sha256} wrongly"

        def ordered(levels: PriorityLevels) -> object:
            return {t: {p: list(q) for p, q in lv.items()} for t, lv in levels.items()}

        if ordered(self.by_priority) != ordered(self.levels_rebuilt(tasks)):
            return "priority levels differ from the waiting queues"
        waiting_total = sum(len(q) for q in self.waiting.values())
        if waiting_total != self.waiting_count:
            return f"waiting count {self.waiting_count} differs from the queues' {waiting_total}"
        return None


class TimerKind(IntEnum):
    """What a timer is for; also the order in which timers due at the same millisecond
    fire."""

    TXN_EXPIRE = 0
    START = 1
    DEADLINE = 2
    PURGE = 3
    TREE_DEADLINE = 4


Timer = tuple[int, int, int]  # (due_ms, kind, id)


class Timers:
    """The timers, a heap in ``(due_ms, kind, id)`` order. Timers are never removed when
    they become moot: each re-checks the state it was set for when it fires.

    Invariant: a heap, holding every timer still to come that a rebuild from the state
    sets (moot ones besides); a purge at or before its time, since a purge that fires
    early re-arms itself (a root's purge waits for its tree's end)."""

    __slots__ = ("heap",)

    def __init__(self) -> None:
        self.heap: list[Timer] = []

    def push(self, due_ms: int, kind: TimerKind, ident: int) -> None:
        heapq.heappush(self.heap, (due_ms, int(kind), ident))

    def next_due_ms(self) -> int | None:
        """When the earliest timer is due (it may turn out moot), or None."""
        return self.heap[0][0] if self.heap else None

    def pop_due(self, now_ms: int) -> tuple[int, TimerKind, int] | None:
        """The earliest timer due at ``now_ms``, taken off; None when none is due."""
        if not self.heap or self.heap[0][0] > now_ms:
            return None
        due_ms, kind, ident = heapq.heappop(self.heap)
        return due_ms, TimerKind(kind), ident

    def clear(self) -> None:
        self.heap = []

    def check(self, rebuilt: Timers, now_ms: int) -> str | None:
        """What differs from the invariant; ``rebuilt``: the timers a rebuild sets."""
        heap = self.heap
        if any(heap[(i - 1) // 2] > heap[i] for i in range(1, len(heap))):
            return "timers are out of heap order"
        held = set(heap)
        earliest_purge: dict[int, int] = {}
        for due_ms, kind, ident in heap:
            if kind == TimerKind.PURGE:
                earliest_purge[ident] = min(due_ms, earliest_purge.get(ident, due_ms))
        missing = sorted(
            (due_ms, kind, ident)
            for due_ms, kind, ident in rebuilt.heap
            if due_ms > now_ms
            and (due_ms, kind, ident) not in held
            and not (kind == TimerKind.PURGE and earliest_purge.get(ident, due_ms + 1) <= due_ms)
        )
        if missing:
            return f"timers {missing[:3]} are not set"
        return None


class StateIndex:
    """Task ids by state (``by_state``) and each tenant's task count by state
    (``tenant_counts``: a tenant known to the state has its counters even when zero).

    Invariant: equal to a rebuild from the tasks (a tenant's zero counters aside)."""

    __slots__ = ("by_state", "tenant_counts")

    def __init__(self) -> None:
        self.by_state: dict[str, set[int]] = {s.value: set() for s in TaskState}
        self.tenant_counts: dict[str, dict[str, int]] = {}

    def counts(self, tenant: str) -> dict[str, int]:
        """The tenant's counters, made (all zero) if it has none yet."""
        counts = self.tenant_counts.get(tenant)
        if counts is None:
            counts = self.tenant_counts[tenant] = {s.value: 0 for s in TaskState}
        return counts

    def added(self, task: Task) -> None:
        self.by_state[task.state].add(task.id)
        self.counts(task.tenant)[task.state] += 1

    def moved(self, task: Task, old: str, new: str) -> None:
        self.by_state[old].discard(task.id)
        self.by_state[new].add(task.id)
        counts = self.counts(task.tenant)
        counts[old] -= 1
        counts[new] += 1

    def removed(self, task: Task) -> None:
        self.by_state[task.state].discard(task.id)
        self.counts(task.tenant)[task.state] -= 1

    def check(self, tasks: Mapping[int, Task]) -> str | None:
        rebuilt = StateIndex()
        for task in tasks.values():
            rebuilt.added(task)
        if rebuilt.by_state != self.by_state:
            return "by_state index differs from tasks"
        zero = {s.value: 0 for s in TaskState}
        for tenant in set(rebuilt.tenant_counts) | set(self.tenant_counts):
            expected = rebuilt.tenant_counts.get(tenant, zero)
            if self.tenant_counts.get(tenant, expected) != expected:
                return f"counters of tenant {tenant!r} differ: {self.tenant_counts[tenant]}"
        return None


class SlotIndex:
    """The live task holding each slot, by (tenant, slot name).

    Invariant: equal to a rebuild from the live tasks, no slot held by two."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[tuple[str, str], int] = {}

    def holder(self, tenant: str, slot: str) -> int | None:
        return self.holders.get((tenant, slot))

    def hold(self, task: Task) -> None:
        assert task.slot is not None
        self.holders[(task.tenant, task.slot)] = task.id

    def free(self, task: Task) -> None:
        """The task no longer holds its slot (if it held it)."""
        if task.slot is not None and self.holders.get((task.tenant, task.slot)) == task.id:
            del self.holders[(task.tenant, task.slot)]

    def check(self, tasks: Mapping[int, Task]) -> str | None:
        slots: dict[tuple[str, str], int] = {}
        for task in tasks.values():
            if task.slot is not None and task.state in LIVE_STATES:
                slot = (task.tenant, task.slot)
                if slot in slots:
                    return f"slot {slot!r} held by live tasks {slots[slot]} and {task.id}"
                slots[slot] = task.id
        if slots != self.holders:
            return f"slot index differs: {self.holders} vs {slots}"
        return None


class RunningIndex:
    """The running tasks of each worker (a worker's emptied set may stay).

    Invariant: equal to a rebuild from the running tasks, empty sets aside."""

    __slots__ = ("by_worker",)

    def __init__(self) -> None:
        self.by_worker: dict[str, set[int]] = {}

    def started(self, worker_id: str, task_id: int) -> None:
        self.by_worker.setdefault(worker_id, set()).add(task_id)

    def stopped(self, worker_id: str, task_id: int) -> None:
        self.by_worker[worker_id].discard(task_id)

    def on(self, worker_id: str) -> set[int]:
        """The ids running on the worker (a set not to be changed)."""
        return self.by_worker.get(worker_id, set())

    def check(self, tasks: Mapping[int, Task]) -> str | None:
        running: dict[str, set[int]] = {}
        for task in tasks.values():
            if task.state == TaskState.RUNNING and task.worker is not None:
                running.setdefault(task.worker, set()).add(task.id)
        if running != {w: ids for w, ids in self.by_worker.items() if ids}:
            return "running-by-worker index differs"
        return None


class TreeIndex:
    """The tasks of each tracked tree (root id -> ids): the live ones (``live``: a failed
    tree's outstanding tasks are cancelled without a scan) and all, final ones too
    (``members``: the tree view counts them by state without a scan).

    Invariant: equal to a rebuild from the tasks."""

    __slots__ = ("live", "members")

    def __init__(self) -> None:
        self.live: dict[int, set[int]] = {}
        self.members: dict[int, set[int]] = {}

    def added(self, task: Task) -> None:
        if task.root is None:
            return
        if task.state in LIVE_STATES:
            self.live.setdefault(task.root, set()).add(task.id)
        self.members.setdefault(task.root, set()).add(task.id)

    def revived(self, task: Task) -> None:
        """A final task of a tree is live again (a root replayed)."""
        assert task.root is not None
        self.live.setdefault(task.root, set()).add(task.id)

    def ended(self, task: Task) -> None:
        """A live task of a tree is no longer live."""
        assert task.root is not None
        live = self.live[task.root]
        live.discard(task.id)
        if not live:
            del self.live[task.root]

    def removed(self, task: Task) -> None:
        if task.root is None:
            return
        if task.state in LIVE_STATES:
            self.ended(task)
        members = self.members[task.root]
        members.discard(task.id)
        if not members:
            del self.members[task.root]

    def check(self, tasks: Mapping[int, Task]) -> str | None:
        rebuilt = TreeIndex()
        for task in tasks.values():
            rebuilt.added(task)
        if rebuilt.live != self.live:
            return "tree_live index differs from the live tasks of trees"
        if rebuilt.members != self.members:
            return "tree_members index differs from the tasks of trees"
        return None


class DependantsIndex:
    """The live tasks waiting for each unfinished dependency (dependency id -> dependant
    ids, in the order they started to wait): a finish releases its dependants without a
    scan, and blocked tasks stay out of the run queues (docs/DESIGN.md §2,
    "Dependencies").

    Invariant: equal, as sets, to a rebuild from the live tasks' ``waiting_for``."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting: dict[int, dict[int, None]] = {}

    def __contains__(self, dependency: int) -> bool:
        return dependency in self.waiting

    def link(self, task: Task) -> None:
        for dependency in task.waiting_for:
            self.waiting.setdefault(dependency, {})[task.id] = None

    def unlink(self, task: Task) -> None:
        for dependency in task.waiting_for:
            waiting = self.waiting.get(dependency)
            if waiting is not None:
                waiting.pop(task.id, None)
                if not waiting:
                    del self.waiting[dependency]

    def take(self, dependency: int) -> dict[int, None] | None:
        """The dependants of ``dependency``, no longer indexed under it."""
        return self.waiting.pop(dependency, None)

    def check(self, tasks: Mapping[int, Task]) -> str | None:
        expected: dict[int, set[int]] = {}
        for task in tasks.values():
            if task.waiting_for and task.state in LIVE_STATES:
                for dependency in task.waiting_for:
                    expected.setdefault(dependency, set()).add(task.id)
        if expected != {k: set(v) for k, v in self.waiting.items()}:
            return "dependants index differs from the tasks' waiting_for"
        return None


class IdempotencyKeys:
    """(scope, idempotency key) -> the first submission's result, oldest first (so expiry
    only looks at the front); the scope is the tenant (``idempotency_scope``). State, kept
    in the snapshot.

    Invariant: each record under its own (scope, key), valid, in time order, not in the
    future, and remembered only for a submission that created a task."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: OrderedDict[tuple[str, str], SubmissionRecord] = OrderedDict()

    def restore(self, records: Iterable[SubmissionRecord]) -> None:
        self.records = OrderedDict(((r.scope or "", r.key), r) for r in records)

    def get(self, scoped: tuple[str, str]) -> SubmissionRecord | None:
        return self.records.get(scoped)

    def remember(self, scoped: tuple[str, str], record: SubmissionRecord) -> None:
        self.records[scoped] = record

    def expire(self, now_ms: int, retention_ms: int) -> None:
        """Forget the keys first used ``retention_ms`` or more before ``now_ms``."""
        # Records are in created_ms order (the clock never goes back): drop from the front.
        records = self.records
        while records and next(iter(records.values())).created_ms + retention_ms <= now_ms:
            records.popitem(last=False)

    def __bool__(self) -> bool:
        return bool(self.records)

    def check(self, now_ms: int) -> str | None:
        previous_ms = 0
        for key, record in self.records.items():
            if key != (record.scope, record.key) or validate_idempotency_key(key[1]) is not None:
                return f"idempotency record {record.key!r} kept under {key!r}"
            if not previous_ms <= record.created_ms <= now_ms:
                return f"idempotency key {key!r} out of time order ({record.created_ms})"
            previous_ms = record.created_ms
            if all(r.task_id is None for r in record.results):
                return f"idempotency key {key!r} remembered though it created no task"
        return None


class TokenIndex:
    """API tokens by id, and their ids by secret hash (derived).

    Invariant: the hash index equals a rebuild from the tokens, each kept under its id."""

    __slots__ = ("by_id", "ids_by_hash")

    def __init__(self) -> None:
        self.by_id: dict[str, ApiToken] = {}
        self.ids_by_hash: dict[str, str] = {}

    def restore(self, tokens: Iterable[ApiToken]) -> None:
        self.by_id = {t.id: t for t in tokens}
        self.ids_by_hash = {t.sha256: t.id for t in self.by_id.values()}

    def known(self, token_id: str, sha256: str) -> bool:
        return token_id in self.by_id or sha256 in self.ids_by_hash

    def add(self, token: ApiToken) -> None:
        self.by_id[token.id] = token
        self.ids_by_hash[token.sha256] = token.id

    def revoke(self, token_id: str) -> ApiToken | None:
        token = self.by_id.pop(token_id, None)
        if token is not None:
            del self.ids_by_hash[token.sha256]
        return token

    def check(self) -> str | None:
        expected = {t.sha256: t.id for t in self.by_id.values()}
        if expected != self.ids_by_hash or any(k != t.id for k, t in self.by_id.items()):
            return "token index out of step with the tokens"
        return None
