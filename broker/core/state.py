"""The replicated state machine: ``StateMachine.apply(entry) -> Applied``.

Pure and deterministic: no IO, no clock, no randomness, no threads. The
leader, every follower, snapshot loading and the simulation tests run this
same code, so two replicas that applied the same entries hold identical state
(``digest()`` compares them).

Time only moves when an entry carries a later ``time_ms``; timers (delayed
start, deadlines, transaction TTL, purge of old finished tasks) fire in
``(due_ms, kind, id)`` order at the start of the first entry past their due
time, identically on every replica.

Idempotency: a SubmitTasks carrying an ``idempotency_key`` already remembered
creates nothing and returns the first submission's results (``ReplayedResults``).
Keys are scoped to the submitting tenant (``idempotency_scope``: one tenant's key
never replays another's submission), are remembered only when the submission
created at least one task, and are dropped, after the timers, at the first entry at
least ``max(finished-task retention, 24 h)`` past their first use.

Names are tenant-scoped the same way: a slot is held per (tenant, slot), and a
transaction answers only to its own tenant (another's is "not open").

``apply`` returns an ``Applied``: the result and the entry's effects as values
(broker/core/effects.py). ``StateMachine`` is the books (books.py: the records, the
parts that index them, each with its invariant, and a task's moves through them) with
``apply`` dispatching each entry type to its handler, a function over the books in the
subject's module (tasks.py, transactions.py, workers.py, tenants.py, code_artifacts.py,
webhooks.py, schedules.py); this module keeps the clock and the firing of timers, the
queries, snapshots and the invariant check (docs/DESIGN.md §2, "The state machine's
parts"). Other packages import its names from broker/core/__init__.py.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from broker.core import code_artifacts, schedules, tasks, tenants, transactions, webhooks, workers
from broker.core import entries as e
from broker.core.books import Books
from broker.core.capacity import CapacityIndex
from broker.core.dependencies import check_dependency_invariants
from broker.core.effects import Applied, Effect, TaskFinal
from broker.core.indexes import PriorityLevels, TimerKind
from broker.core.records import (
    FINAL_STATES,
    LIVE_STATES,
    TASK_HOLDING_WORKER_STATES,
    ApiToken,
    ApplyResult,
    InvariantError,
    SubmissionRecord,
    Task,
    TreeRecord,
    TreeState,
    WorkerState,
    idempotency_scope,
)
from broker.core.served_types import type_served
from broker.core.snapshot_body import (
    SNAPSHOT_BODY_VERSION,
    SnapshotBody,
    _snapshot_encoder,
    body_version,
    decode_snapshot_body,
)
from broker.core.transitions import TaskState
from broker.core.trees import check_tree_invariants
from broker.core.validation import (
    IDEMPOTENCY_MIN_RETENTION_MS,
)

# Each entry type's handler: a function over the books (broker/core/books.py).
_HANDLERS: dict[type[Any], Callable[[Any, Any], ApplyResult]] = {
    e.SubmitTasks: workers.submit_placed,
    e.CancelTask: tasks.cancel,
    e.BeginTransaction: transactions.begin,
    e.CommitTransaction: transactions.commit,
    e.RollbackTransaction: transactions.rollback,
    e.SetTenant: tenants.set_tenant,
    e.SetConfig: tenants.set_config,
    e.Tick: tenants.tick,
    e.RegisterWorker: workers.register_worker,
    e.WorkerDead: workers.worker_dead,
    e.WorkerSilent: workers.worker_silent,
    e.WorkerDisconnected: workers.worker_disconnected,
    e.AssignTasks: workers.assign,
    e.FinishTasks: workers.finish,
    e.AddCode: code_artifacts.add_code,
    e.CodeReady: code_artifacts.code_ready,
    e.CreateToken: tenants.create_token,
    e.RevokeToken: tenants.revoke_token,
    e.DeleteCode: code_artifacts.delete_code,
    e.CreateSchedule: schedules.create_schedule,
    e.DeleteSchedule: schedules.delete_schedule,
    e.FireSchedule: schedules.fire_schedule,
    e.PauseSchedule: schedules.pause_schedule,
    e.CancelTasks: tasks.cancel_many,
    e.SetWebhook: webhooks.set_webhook,
    e.WebhookProgress: webhooks.webhook_progress,
}


class StateMachine(Books):
    """The replicated state machine: the books (records and parts) with the entry point,
    the clock and its timers, read-only queries, snapshots and the invariant check."""

    # --- the parts' contents, by the names readers use ----------------------------------

    @property
    def waiting(self) -> dict[str, dict[int, None]]:
        return self.queues.waiting

    @property
    def waiting_count(self) -> int:
        return self.queues.waiting_count

    @property
    def by_priority(self) -> PriorityLevels:
        return self.queues.by_priority

    @property
    def parked(self) -> dict[str, dict[int, None]]:
        return self.queues.parked

    @property
    def by_state(self) -> dict[str, set[int]]:
        return self.states.by_state

    @property
    def tenant_counts(self) -> dict[str, dict[str, int]]:
        return self.states.tenant_counts

    @property
    def slots(self) -> dict[tuple[str, str], int]:
        return self.slot_index.holders

    @property
    def running_by_worker(self) -> dict[str, set[int]]:
        return self.running.by_worker

    @property
    def tree_live(self) -> dict[int, set[int]]:
        return self.tree_index.live

    @property
    def tree_members(self) -> dict[int, set[int]]:
        return self.tree_index.members

    @property
    def dependants(self) -> dict[int, dict[int, None]]:
        return self.dependant_index.waiting

    @property
    def idempotency(self) -> dict[tuple[str, str], SubmissionRecord]:
        return self.idempotency_keys.records

    @property
    def tokens(self) -> dict[str, ApiToken]:
        return self.token_index.by_id

    @property
    def token_ids_by_hash(self) -> dict[str, str]:
        return self.token_index.ids_by_hash

    def apply(self, entry: e.Entry) -> Applied:
        """Apply one entry: its result and, as values, its effects (in order)."""
        effects: list[Effect] = []
        self.effects = effects
        self._advance_clock(entry.time_ms)
        self.entries_applied += 1
        result = _HANDLERS[type(entry)](self, entry)
        self.effects = []
        if self.webhook_outbox and effects:
            webhooks.queue_webhook_events(
                self, [effect.task_id for effect in effects if type(effect) is TaskFinal]
            )
        return Applied(result, tuple(effects))

    def next_timer_ms(self) -> int | None:
        """When the earliest timer is due (it may turn out moot), or None."""
        return self.timers.next_due_ms()

    def _advance_clock(self, time_ms: int) -> None:
        if time_ms > self.now_ms:
            self.now_ms = time_ms
        while (due := self.timers.pop_due(self.now_ms)) is not None:
            self._fire(*due)
        if self.idempotency_keys:
            self.idempotency_keys.expire(self.now_ms, self.idempotency_retention_ms())

    def idempotency_retention_ms(self) -> int:
        return max(self.config.finished_task_retention_ms, IDEMPOTENCY_MIN_RETENTION_MS)

    def _fire(self, due_ms: int, kind: TimerKind, ident: int) -> None:
        # Timers are never removed when they become moot; each one re-checks
        # the state it was set for, so stale ones are ignored deterministically.
        if kind is TimerKind.TXN_EXPIRE:
            txn = self.transactions.get(ident)
            if txn is not None and txn.expires_ms == due_ms:
                transactions.drop_transaction(self, txn)
            return
        if kind is TimerKind.TREE_DEADLINE:
            tree = self.trees.get(ident)
            if tree is not None and tree.state == TreeState.PENDING and tree.deadline_ms == due_ms:
                # Timers are not removed: a replayed run has another deadline (or none yet).
                self.fail_tree(tree, "tree timed out")
            return
        task = self.tasks.get(ident)
        if task is None:
            return
        if kind is TimerKind.START:
            if task.state == TaskState.DELAYED and task.start_after_ms == due_ms:
                self.move(task, TaskState.WAITING)
        elif kind is TimerKind.DEADLINE:
            if task.state in LIVE_STATES and task.deadline_ms == due_ms:
                task.error = "deadline exceeded"
                self.stop_if_running(task, "deadline exceeded")
                self.move(task, TaskState.ERROR)
                self.task_ended(task)
        elif (
            kind is TimerKind.PURGE and task.state in FINAL_STATES and task.finished_ms is not None
        ):
            purge_ms = self.purge_ms(task)
            if self.tree_pending(task.id):
                pass  # a root outlives its pending tree (it may be replayed); re-armed at the end
            elif purge_ms <= self.now_ms:
                self.delete_task(task)
            elif purge_ms != due_ms:
                self.push_timer(purge_ms, TimerKind.PURGE, task.id)

    # --- read-only queries ---------------------------------------------------------------

    def tree(self, task_id: int) -> TreeRecord | None:
        """The tree record of a tracked root (None for other tasks)."""
        return self.trees.get(task_id)

    def type_served(self, tenant: str, type_name: str) -> bool | None:
        """Whether a worker serving ``tenant`` ever listed ``type_name`` (served_types.py)."""
        return type_served(self, tenant, type_name)

    def unreceived_attempts(
        self,
        worker_id: str,
        process_id: str,
        credential: str | None,
        listed: tuple[e.TaskAttempt, ...],
    ) -> tuple[e.TaskAttempt, ...]:
        """The attempts a reconnecting worker process never received (workers.py)."""
        return workers.unreceived_attempts(self, worker_id, process_id, credential, listed)

    def registration_loses_attempts(
        self, worker_id: str, running: tuple[e.TaskAttempt, ...]
    ) -> bool:
        """Whether a registration would end attempts as lost (workers.py)."""
        return workers.registration_loses_attempts(self, worker_id, running)

    def code_users(self, sha256: str) -> list[int]:
        """Ids of the tasks that need the artifact (code_artifacts.py)."""
        return code_artifacts.code_users(self, sha256)

    def codes_in_use(self) -> set[str]:
        """Every artifact a task needs (code_artifacts.py)."""
        return code_artifacts.codes_in_use(self)

    def unneeded_artifacts(self, unused_for_ms: int, now_ms: int | None = None) -> list[str]:
        """Code retention's candidates (code_artifacts.py)."""
        return code_artifacts.unneeded_artifacts(self, unused_for_ms, now_ms)

    def count_by_state(self) -> dict[str, int]:
        return {state: len(ids) for state, ids in self.by_state.items()}

    def tenant_counts_view(self, tenant: str) -> dict[str, int]:
        return dict(self.tenant_counts.get(tenant) or {s.value: 0 for s in TaskState})

    def list_tasks(
        self,
        *,
        state: str | None = None,
        tenant: str | None = None,
        task_type: str | None = None,
        after_id: int = 0,
        before_id: int | None = None,
        limit: int = 100,
        newest_first: bool = False,
    ) -> list[Task]:
        """Matching tasks with after_id < id < before_id, at most ``limit``: the lowest ids
        ascending, or with ``newest_first`` the highest ids descending."""
        tasks = self.tasks

        def matching(candidates: Iterable[int]) -> Iterator[int]:
            for task_id in candidates:
                if task_id <= after_id or (before_id is not None and task_id >= before_id):
                    continue
                task = tasks[task_id]
                if tenant is not None and task.tenant != tenant:
                    continue
                if task_type is not None and task.type != task_type:
                    continue
                yield task_id

        if newest_first and state is None:
            # Ids are applied in increasing order (snapshots keep it), so the task map walked
            # backwards is newest first and the walk stops after ``limit`` matches.
            return [tasks[i] for i in itertools.islice(matching(reversed(tasks)), limit)]
        candidates: Iterable[int] = self.by_state[state] if state is not None else tasks
        pick = heapq.nlargest if newest_first else heapq.nsmallest
        return [tasks[i] for i in pick(limit, matching(candidates))]

    def snapshot_body(self) -> SnapshotBody:
        body = SnapshotBody(
            format_version=SNAPSHOT_BODY_VERSION,
            now_ms=self.now_ms,
            max_task_id=self.max_task_id,
            max_transaction_id=self.max_transaction_id,
            config=self.config,
            tenants=list(self.tenants.values()),
            tasks=list(self.tasks.values()),
            transactions=list(self.transactions.values()),
            workers=list(self.workers.values()),
            artifacts=list(self.artifacts.values()),
            # Sorted: a tenant's emptied queue keeps its place in self.waiting but
            # is left out here, so insertion order would differ after a reload.
            waiting={name: list(queue) for name, queue in sorted(self.waiting.items()) if queue},
            idempotency=list(self.idempotency.values()),
            trees=list(self.trees.values()),
            tokens=list(self.tokens.values()),
            schedules=list(self.schedules.values()),
            webhook_outbox={name: list(box) for name, box in sorted(self.webhook_outbox.items())},
            served_types={name: list(names) for name, names in sorted(self.served_types.items())},
            served_types_full=sorted(self.served_types_full),
        )
        # In the oldest version that keeps it all (docs/OPERATIONS.md, "Rolling upgrade").
        body.format_version = body_version(body)
        return body

    def encode_snapshot(self) -> bytes:
        return _snapshot_encoder.encode(self.snapshot_body())

    def digest(self) -> str:
        return hashlib.sha256(self.encode_snapshot()).hexdigest()

    @classmethod
    def from_snapshot(cls, data: bytes) -> StateMachine:
        body = decode_snapshot_body(data)
        machine = cls()
        machine.now_ms = body.now_ms
        machine.max_task_id = body.max_task_id
        machine.max_transaction_id = body.max_transaction_id
        machine.config = body.config
        machine.tenants = {t.name: t for t in body.tenants}
        for name in machine.tenants:
            machine.counts(name)
        machine.transactions = {t.id: t for t in body.transactions}
        machine.workers = {w.id: w for w in body.workers}
        machine.artifacts = {a.sha256: a for a in body.artifacts}
        # Restore the exact waiting order first; add_task keeps it (setdefault).
        machine.queues.restore_order(body.waiting)
        for task in body.tasks:
            machine.add_task(task)
        machine.queues.rebuild_levels(machine.tasks)  # add_task filed them by id
        for txn in machine.transactions.values():
            machine.push_timer(txn.expires_ms, TimerKind.TXN_EXPIRE, txn.id)
        for record in body.idempotency:
            if record.scope is None:
                record.scope = machine._legacy_scope(record)
        machine.idempotency_keys.restore(body.idempotency)
        machine.trees = {t.root: t for t in body.trees}
        machine.push_tree_timers()
        machine.token_index.restore(body.tokens)
        machine.schedules = {(s.tenant, s.name): s for s in body.schedules}
        # A snapshot from before the outboxes: each webhook's starts empty.
        machine.webhook_outbox = {
            t.name: deque(body.webhook_outbox.get(t.name, ()))
            for t in body.tenants
            if t.webhook is not None
        }
        machine.served_types = {
            name: dict.fromkeys(names) for name, names in body.served_types.items()
        }
        machine.served_types_full = set(body.served_types_full)
        return machine

    def _legacy_scope(self, record: SubmissionRecord) -> str:
        """The scope of a key remembered before keys were scoped: its tasks' tenants, as
        its submission had them. Its tasks may all be purged: then "" (no tenant's scope),
        and the key is forgotten a little early."""
        tenants = [
            task.tenant
            for r in record.results
            if r.task_id is not None and (task := self.tasks.get(r.task_id)) is not None
        ]
        return idempotency_scope(tenants)

    def check_invariants(self) -> None:
        """Check every part against its invariant (each derived index against a rebuild)
        and the records against each other; raise on the first mismatch."""

        def fail(message: str) -> None:
            raise InvariantError(message)

        parts = (
            self.token_index.check(),
            self.states.check(self.tasks),
            self.slot_index.check(self.tasks),
            self.running.check(self.tasks),
            self.tree_index.check(self.tasks),
            self.dependant_index.check(self.tasks),
            self.queues.check(self.tasks, self.code_blocked, self._artifact_ready),
            self.idempotency_keys.check(self.now_ms),
            self.timers.check(self.timers_rebuilt(), self.now_ms),
        )
        for problem in parts:
            if problem is not None:
                fail(problem)
        if (capacity := self._check_capacity()) is not None:
            fail(capacity)
        for task_id, task in self.tasks.items():
            if task_id != task.id:
                fail(f"task keyed {task_id} has id {task.id}")
            if task.id > self.max_task_id:
                fail(f"task {task.id} above max_task_id {self.max_task_id}")
            if task.state == TaskState.RUNNING:
                if task.worker is None:
                    fail(f"running task {task.id} has no worker")
                else:
                    worker = self.workers.get(task.worker)
                    if worker is None or worker.state not in TASK_HOLDING_WORKER_STATES:
                        fail(f"task {task.id} runs on a worker that is dead or unknown")
                if not 1 <= task.counted_attempts() <= task.max_attempts:
                    fail(f"running task {task.id} has attempt {task.attempt}")
            if task.state == TaskState.PENDING:
                txn = self.transactions.get(task.transaction or -1)
                if txn is None or task.id not in txn.task_ids:
                    fail(f"pending task {task.id} outside an open transaction")
            if task.tenant not in self.tenants:
                fail(f"task {task.id} of unknown tenant {task.tenant!r}")
        for known in self.artifacts.values():
            uploaders = [u.tenant for u in known.uploads]
            if len(set(uploaders)) != len(uploaders):
                fail(f"artifact {known.sha256} records a tenant's upload twice")
        blocked_total = check_dependency_invariants(self, fail)
        if len(self.queues) + blocked_total != len(self.by_state[TaskState.WAITING]):
            fail("waiting queues and waiting tasks differ in number")
        for txn in self.transactions.values():
            states = {self.tasks[i].state for i in txn.task_ids if i in self.tasks}
            if states - {TaskState.PENDING.value}:
                fail(f"transaction {txn.id} holds non-pending tasks: {states}")
        for worker in self.workers.values():
            since_ms = worker.silent_since_ms
            if since_ms is not None and (
                worker.state not in TASK_HOLDING_WORKER_STATES
                or not worker.connected_ms <= since_ms <= self.now_ms
            ):
                fail(f"worker {worker.id} silent since {since_ms}, {worker.state}")
            if worker.state == WorkerState.DISCONNECTED and since_ms is None:
                fail(f"disconnected worker {worker.id} has no last contact")
        check_tree_invariants(self, fail)
        if (problem := schedules.check_schedule_invariants(self)) is not None:
            fail(problem)

    def _artifact_ready(self, sha256: str) -> bool | None:
        artifact = self.artifacts.get(sha256)
        return None if artifact is None else artifact.ready

    def _check_capacity(self) -> str | None:
        """What differs between the capacity index and a rebuild."""
        built = self.capacity()  # built now if no reader has asked yet: kept from here on
        fresh = CapacityIndex(self.workers, self.tasks, self.running.by_worker)
        if fresh == built:
            return None
        return "capacity index differs from a rebuild"
