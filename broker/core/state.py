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
(broker/core/effects.py). The handlers live in one mixin per subject over
``MachineBase`` (machine_base.py: the shared attributes and task bookkeeping):
tasks.py, transactions.py, trees.py, workers.py, tenants.py (with config and API
tokens) and code_artifacts.py; this module combines them and keeps the clock, the
timers, queries, snapshots and the invariant check. Every name other modules import
from here is re-exported here.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from broker.core import entries as e
from broker.core.code_artifacts import CodeArtifactsMixin
from broker.core.effects import Applied as Applied
from broker.core.effects import Effect as Effect
from broker.core.effects import TaskAssigned as TaskAssigned
from broker.core.effects import TaskFinal as TaskFinal
from broker.core.effects import TreeEnded as TreeEnded
from broker.core.machine_base import MachineBase as MachineBase
from broker.core.machine_base import _Timer
from broker.core.records import FINAL_STATES as FINAL_STATES
from broker.core.records import LIVE_STATES as LIVE_STATES
from broker.core.records import QUEUED_STATES as QUEUED_STATES
from broker.core.records import TASK_HOLDING_WORKER_STATES as TASK_HOLDING_WORKER_STATES
from broker.core.records import ApiToken as ApiToken
from broker.core.records import ApplyResult as ApplyResult
from broker.core.records import Artifact as Artifact
from broker.core.records import ArtifactUpload as ArtifactUpload
from broker.core.records import CancelCount as CancelCount
from broker.core.records import Config as Config
from broker.core.records import ErrorCode as ErrorCode
from broker.core.records import InvariantError as InvariantError
from broker.core.records import Rejected as Rejected
from broker.core.records import RememberedResult as RememberedResult
from broker.core.records import ReplayedResults as ReplayedResults
from broker.core.records import StopRunning as StopRunning
from broker.core.records import SubmissionRecord as SubmissionRecord
from broker.core.records import Task as Task
from broker.core.records import TaskRef as TaskRef
from broker.core.records import Tenant as Tenant
from broker.core.records import Transaction as Transaction
from broker.core.records import TransactionDone as TransactionDone
from broker.core.records import TransactionRef as TransactionRef
from broker.core.records import TreeRecord as TreeRecord
from broker.core.records import TreeState as TreeState
from broker.core.records import Worker as Worker
from broker.core.records import WorkerReconciled as WorkerReconciled
from broker.core.records import WorkerState as WorkerState
from broker.core.records import idempotency_scope as idempotency_scope
from broker.core.records import tree_value as tree_value
from broker.core.schedules import Schedule as Schedule
from broker.core.schedules import SchedulesMixin
from broker.core.snapshot_body import SNAPSHOT_BODY_VERSION as SNAPSHOT_BODY_VERSION
from broker.core.snapshot_body import SnapshotBody as SnapshotBody
from broker.core.snapshot_body import _snapshot_encoder, body_version, decode_snapshot_body
from broker.core.tenants import TenantsMixin
from broker.core.transitions import TaskState as TaskState
from broker.core.validation import IDEMPOTENCY_KEY_RE as IDEMPOTENCY_KEY_RE
from broker.core.validation import IDEMPOTENCY_MIN_RETENTION_MS as IDEMPOTENCY_MIN_RETENTION_MS
from broker.core.validation import MAX_ATTEMPTS_LIMIT as MAX_ATTEMPTS_LIMIT
from broker.core.validation import MAX_RESOURCES as MAX_RESOURCES
from broker.core.validation import MAX_SLOT_CHARS as MAX_SLOT_CHARS
from broker.core.validation import MAX_TOKEN_NAME_CHARS as MAX_TOKEN_NAME_CHARS
from broker.core.validation import MAX_TOKEN_TENANTS as MAX_TOKEN_TENANTS
from broker.core.validation import MAX_TREE_TIMEOUT_MS as MAX_TREE_TIMEOUT_MS
from broker.core.validation import NAME_RE as NAME_RE
from broker.core.validation import TASK_TYPE_RE as TASK_TYPE_RE
from broker.core.validation import TOKEN_ROLES as TOKEN_ROLES
from broker.core.validation import validate_idempotency_key as validate_idempotency_key
from broker.core.validation import validate_limits as validate_limits
from broker.core.validation import validate_task_spec as validate_task_spec
from broker.core.validation import validate_token_fields as validate_token_fields
from broker.core.webhooks import WebhooksMixin
from broker.core.workers import WorkersMixin


class StateMachine(SchedulesMixin, WorkersMixin, TenantsMixin, CodeArtifactsMixin, WebhooksMixin):
    """The replicated state machine: the subject mixins combined, with the entry point,
    the clock and its timers, read-only queries, snapshots and the invariant check."""

    def __init__(self) -> None:
        super().__init__()
        self._handlers: dict[type[Any], Callable[[Any], ApplyResult]] = {
            e.SubmitTasks: self._submit_placed,
            e.CancelTask: self._cancel,
            e.BeginTransaction: self._begin,
            e.CommitTransaction: self._commit,
            e.RollbackTransaction: self._rollback,
            e.SetTenant: self._set_tenant,
            e.SetConfig: self._set_config,
            e.Tick: self._tick,
            e.RegisterWorker: self._register_worker,
            e.WorkerDead: self._worker_dead,
            e.WorkerSilent: self._worker_silent,
            e.WorkerDisconnected: self._worker_disconnected,
            e.AssignTasks: self._assign,
            e.FinishTasks: self._finish,
            e.AddCode: self._add_code,
            e.CodeReady: self._code_ready,
            e.CreateToken: self._create_token,
            e.RevokeToken: self._revoke_token,
            e.DeleteCode: self._delete_code,
            e.CreateSchedule: self._create_schedule,
            e.DeleteSchedule: self._delete_schedule,
            e.FireSchedule: self._fire_schedule,
            e.PauseSchedule: self._pause_schedule,
            e.CancelTasks: self._cancel_many,
            e.SetWebhook: self._set_webhook,
            e.WebhookProgress: self._webhook_progress,
        }

    def apply(self, entry: e.Entry) -> Applied:
        """Apply one entry: its result and, as values, its effects (in order)."""
        effects: list[Effect] = []
        self._effects = effects
        self._advance_clock(entry.time_ms)
        self.entries_applied += 1
        result = self._handlers[type(entry)](entry)
        self._effects = []
        if self.webhook_outbox and effects:
            self._queue_webhook_events(
                [effect.task_id for effect in effects if type(effect) is TaskFinal]
            )
        return Applied(result, tuple(effects))

    def next_timer_ms(self) -> int | None:
        """When the earliest timer is due (it may turn out moot), or None."""
        return self._timers[0][0] if self._timers else None

    def _advance_clock(self, time_ms: int) -> None:
        if time_ms > self.now_ms:
            self.now_ms = time_ms
        timers = self._timers
        while timers and timers[0][0] <= self.now_ms:
            due_ms, kind, ident = heapq.heappop(timers)
            self._fire(due_ms, _Timer(kind), ident)
        if self.idempotency:
            self._expire_idempotency_keys()

    def idempotency_retention_ms(self) -> int:
        return max(self.config.finished_task_retention_ms, IDEMPOTENCY_MIN_RETENTION_MS)

    def _expire_idempotency_keys(self) -> None:
        # Records are in created_ms order (the clock never goes back): drop from the front.
        retention_ms = self.idempotency_retention_ms()
        keys = self.idempotency
        while keys and next(iter(keys.values())).created_ms + retention_ms <= self.now_ms:
            keys.popitem(last=False)

    def _fire(self, due_ms: int, kind: _Timer, ident: int) -> None:
        # Timers are never removed when they become moot; each one re-checks
        # the state it was set for, so stale ones are ignored deterministically.
        if kind is _Timer.TXN_EXPIRE:
            txn = self.transactions.get(ident)
            if txn is not None and txn.expires_ms == due_ms:
                self._drop_transaction(txn)
            return
        if kind is _Timer.TREE_DEADLINE:
            tree = self.trees.get(ident)
            if tree is not None and tree.state == TreeState.PENDING and tree.deadline_ms == due_ms:
                # Timers are not removed: a replayed run has another deadline (or none yet).
                self._fail_tree(tree, "tree timed out")
            return
        task = self.tasks.get(ident)
        if task is None:
            return
        if kind is _Timer.START:
            if task.state == TaskState.DELAYED and task.start_after_ms == due_ms:
                self._move(task, TaskState.WAITING)
        elif kind is _Timer.DEADLINE:
            if task.state in LIVE_STATES and task.deadline_ms == due_ms:
                task.error = "deadline exceeded"
                self._stop_if_running(task, "deadline exceeded")
                self._move(task, TaskState.ERROR)
                self._task_ended(task)
        elif kind is _Timer.PURGE and task.state in FINAL_STATES and task.finished_ms is not None:
            purge_ms = self._purge_ms(task)
            if self._tree_pending(task.id):
                pass  # a root outlives its pending tree (it may be replayed); re-armed at the end
            elif purge_ms <= self.now_ms:
                self._delete_task(task)
            elif purge_ms != due_ms:
                self._push_timer(purge_ms, _Timer.PURGE, task.id)

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
            machine._counts(name)
        machine.transactions = {t.id: t for t in body.transactions}
        machine.workers = {w.id: w for w in body.workers}
        machine.artifacts = {a.sha256: a for a in body.artifacts}
        # Restore the exact waiting order first; _add_task keeps it (setdefault).
        machine.waiting = {name: dict.fromkeys(ids) for name, ids in body.waiting.items()}
        for task in body.tasks:
            machine._add_task(task)
        machine.by_priority = machine._priority_levels()  # _add_task filed them by id
        for txn in machine.transactions.values():
            machine._push_timer(txn.expires_ms, _Timer.TXN_EXPIRE, txn.id)
        for record in body.idempotency:
            if record.scope is None:
                record.scope = machine._legacy_scope(record)
        machine.idempotency = OrderedDict(((r.scope or "", r.key), r) for r in body.idempotency)
        machine.trees = {t.root: t for t in body.trees}
        machine._push_tree_timers()
        machine.tokens = {t.id: t for t in body.tokens}
        machine.token_ids_by_hash = {t.sha256: t.id for t in body.tokens}
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
        """Recompute every derived index from scratch and compare; raise on a mismatch."""

        def fail(message: str) -> None:
            raise InvariantError(message)

        expected_hashes = {t.sha256: t.id for t in self.tokens.values()}
        if expected_hashes != self.token_ids_by_hash or any(
            k != t.id for k, t in self.tokens.items()
        ):
            fail("token index out of step with the tokens")
        by_state: dict[str, set[int]] = {s.value: set() for s in TaskState}
        counts: dict[str, dict[str, int]] = {}
        slots: dict[tuple[str, str], int] = {}
        running: dict[str, set[int]] = {}
        for task_id, task in self.tasks.items():
            if task_id != task.id:
                fail(f"task keyed {task_id} has id {task.id}")
            if task.id > self.max_task_id:
                fail(f"task {task.id} above max_task_id {self.max_task_id}")
            by_state[task.state].add(task.id)
            per = counts.setdefault(task.tenant, {s.value: 0 for s in TaskState})
            per[task.state] += 1
            if task.slot is not None and task.state in LIVE_STATES:
                slot = (task.tenant, task.slot)
                if slot in slots:
                    fail(f"slot {slot!r} held by live tasks {slots[slot]} and {task.id}")
                slots[slot] = task.id
            if task.state == TaskState.RUNNING:
                if task.worker is None:
                    fail(f"running task {task.id} has no worker")
                else:
                    running.setdefault(task.worker, set()).add(task.id)
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
        if by_state != self.by_state:
            fail("by_state index differs from tasks")
        for tenant in set(counts) | set(self.tenant_counts):
            expected = counts.get(tenant, {s.value: 0 for s in TaskState})
            if self.tenant_counts.get(tenant, expected) != expected:
                fail(f"counters of tenant {tenant!r} differ: {self.tenant_counts[tenant]}")
        if slots != self.slots:
            fail(f"slot index differs: {self.slots} vs {slots}")
        actual_running = {w: ids for w, ids in self.running_by_worker.items() if ids}
        if running != actual_running:
            fail("running-by-worker index differs")
        if (capacity := self._check_capacity()) is not None:
            fail(capacity)
        for tenant, queue in self.waiting.items():
            for task_id in queue:
                queued = self.tasks.get(task_id)
                if queued is None or queued.state != TaskState.WAITING or queued.tenant != tenant:
                    fail(f"waiting queue of {tenant!r} holds task {task_id} wrongly")
                if queued is not None and self._code_blocked(queued):
                    fail(f"task {task_id} is queued though its code is not ready")
        for known in self.artifacts.values():
            uploaders = [u.tenant for u in known.uploads]
            if len(set(uploaders)) != len(uploaders):
                fail(f"artifact {known.sha256} records a tenant's upload twice")
        for sha256, parked in self.parked.items():
            artifact = self.artifacts.get(sha256)
            if artifact is None or artifact.ready or not parked:
                fail(f"tasks parked on artifact {sha256} that is unknown, ready or empty")
            for task_id in parked:
                held = self.tasks.get(task_id)
                if held is None or held.state != TaskState.WAITING or held.code != sha256:
                    fail(f"task {task_id} is parked on artifact {sha256} wrongly")

        def ordered(levels: dict[str, dict[int, dict[int, None]]]) -> object:
            return {t: {p: list(q) for p, q in lv.items()} for t, lv in levels.items()}

        if ordered(self.by_priority) != ordered(self._priority_levels()):
            fail("priority levels differ from the waiting queues")
        waiting_total = sum(len(q) for q in self.waiting.values())
        if waiting_total != self.waiting_count:
            fail(f"waiting count {self.waiting_count} differs from the queues' {waiting_total}")
        parked_total = sum(len(p) for p in self.parked.values())
        blocked_total = self._check_dependency_invariants(fail)
        if waiting_total + parked_total + blocked_total != len(self.by_state[TaskState.WAITING]):
            fail("waiting queues and waiting tasks differ in number")
        for txn in self.transactions.values():
            states = {self.tasks[i].state for i in txn.task_ids if i in self.tasks}
            if states - {TaskState.PENDING.value}:
                fail(f"transaction {txn.id} holds non-pending tasks: {states}")
        previous_ms = 0
        for key, record in self.idempotency.items():
            if key != (record.scope, record.key) or validate_idempotency_key(key[1]) is not None:
                fail(f"idempotency record {record.key!r} kept under {key!r}")
            if not previous_ms <= record.created_ms <= self.now_ms:
                fail(f"idempotency key {key!r} out of time order ({record.created_ms})")
            previous_ms = record.created_ms
            if all(r.task_id is None for r in record.results):
                fail(f"idempotency key {key!r} remembered though it created no task")
        for worker in self.workers.values():
            since_ms = worker.silent_since_ms
            if since_ms is not None and (
                worker.state not in TASK_HOLDING_WORKER_STATES
                or not worker.connected_ms <= since_ms <= self.now_ms
            ):
                fail(f"worker {worker.id} silent since {since_ms}, {worker.state}")
            if worker.state == WorkerState.DISCONNECTED and since_ms is None:
                fail(f"disconnected worker {worker.id} has no last contact")
        self._check_tree_invariants(fail)
        if (problem := self._check_schedule_invariants()) is not None:
            fail(problem)
