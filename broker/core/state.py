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
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from enum import IntEnum
from typing import Any

from broker.core import entries as e
from broker.core.effects import Applied as Applied
from broker.core.effects import Effect as Effect
from broker.core.effects import TaskFinal as TaskFinal
from broker.core.effects import TreeEnded as TreeEnded
from broker.core.entries import SHA256_RE
from broker.core.records import _MASK64
from broker.core.records import FINAL_STATES as FINAL_STATES
from broker.core.records import LIVE_STATES as LIVE_STATES
from broker.core.records import QUEUED_STATES as QUEUED_STATES
from broker.core.records import ApiToken as ApiToken
from broker.core.records import ApplyResult as ApplyResult
from broker.core.records import Artifact as Artifact
from broker.core.records import ArtifactUpload as ArtifactUpload
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
from broker.core.snapshot_body import SNAPSHOT_BODY_VERSION as SNAPSHOT_BODY_VERSION
from broker.core.snapshot_body import SnapshotBody as SnapshotBody
from broker.core.snapshot_body import _snapshot_decoder, _snapshot_encoder
from broker.core.transitions import TaskState as TaskState  # re-exported: its old home
from broker.core.transitions import check_move
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


class _Timer(IntEnum):
    # Order in which timers due at the same millisecond fire.
    TXN_EXPIRE = 0
    START = 1
    DEADLINE = 2
    PURGE = 3
    TREE_DEADLINE = 4


class StateMachine:
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
        self._timers: list[tuple[int, int, int]] = []  # (due_ms, kind, id)
        self.entries_applied = 0
        # The effects of the entry being applied, returned by apply (broker.core.effects);
        # not state.
        self._effects: list[Effect] = []
        self._handlers: dict[type[Any], Callable[[Any], ApplyResult]] = {
            e.SubmitTasks: self._submit,
            e.CancelTask: self._cancel,
            e.BeginTransaction: self._begin,
            e.CommitTransaction: self._commit,
            e.RollbackTransaction: self._rollback,
            e.SetTenant: self._set_tenant,
            e.SetConfig: self._set_config,
            e.Tick: self._tick,
            e.RegisterWorker: self._register_worker,
            e.WorkerDead: self._worker_dead,
            e.AssignTasks: self._assign,
            e.FinishTasks: self._finish,
            e.AddCode: self._add_code,
            e.CodeReady: self._code_ready,
            e.CreateToken: self._create_token,
            e.RevokeToken: self._revoke_token,
        }

    # --- entry point ---------------------------------------------------------

    def apply(self, entry: e.Entry) -> Applied:
        """Apply one entry: its result and, as values, its effects (in order)."""
        effects: list[Effect] = []
        self._effects = effects
        self._advance_clock(entry.time_ms)
        self.entries_applied += 1
        result = self._handlers[type(entry)](entry)
        self._effects = []
        return Applied(result, tuple(effects))

    # --- time ----------------------------------------------------------------

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

    def _push_timer(self, due_ms: int, kind: _Timer, ident: int) -> None:
        heapq.heappush(self._timers, (due_ms, int(kind), ident))

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

    # --- state transitions -----------------------------------------------------

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
        if task.root is not None and task.state in LIVE_STATES:
            self.tree_live.setdefault(task.root, set()).add(task.id)
        self._push_task_timers(task)

    def _code_blocked(self, task: Task) -> bool:
        """Whether the task's code artifact is not ready (then it may not be scheduled)."""
        code = task.code
        if code is None:
            return False
        artifact = self.artifacts.get(code)
        return artifact is not None and not artifact.ready

    def _enqueue(self, task: Task) -> None:
        """File a task that became waiting: in its tenant's queue, or parked on its code."""
        if task.code is not None and self._code_blocked(task):
            self.parked.setdefault(task.code, {})[task.id] = None
        else:
            self.waiting.setdefault(task.tenant, {})[task.id] = None

    def _dequeue(self, task: Task) -> None:
        # Readiness only goes from False to True, and readying releases every parked
        # task at once: a waiting task is parked exactly while its code is blocked.
        if task.code is not None and self._code_blocked(task):
            parked = self.parked[task.code]
            del parked[task.id]
            if not parked:
                del self.parked[task.code]
        else:
            del self.waiting[task.tenant][task.id]

    def _push_task_timers(self, task: Task) -> None:
        if task.state == TaskState.DELAYED and task.start_after_ms is not None:
            self._push_timer(task.start_after_ms, _Timer.START, task.id)
        if task.state in LIVE_STATES and task.deadline_ms is not None:
            self._push_timer(task.deadline_ms, _Timer.DEADLINE, task.id)
        if task.state in FINAL_STATES and task.finished_ms is not None:
            self._push_timer(self._purge_ms(task), _Timer.PURGE, task.id)

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
            self._push_timer(
                self.now_ms + self.config.finished_task_retention_ms, _Timer.PURGE, task.id
            )

    def _delete_task(self, task: Task) -> None:
        check_move(task.state, None)
        del self.tasks[task.id]
        self.by_state[task.state].discard(task.id)
        self._counts(task.tenant)[task.state] -= 1
        if task.state == TaskState.WAITING:
            self._dequeue(task)
        elif task.state == TaskState.RUNNING and task.worker is not None:
            self.running_by_worker[task.worker].discard(task.id)
        if task.slot is not None and self.slots.get((task.tenant, task.slot)) == task.id:
            del self.slots[(task.tenant, task.slot)]
        if task.root is not None and task.state in LIVE_STATES:
            self._untrack_live(task)
        if task.root == task.id:
            self.trees.pop(task.id, None)

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

    # --- handlers ------------------------------------------------------------------

    def _submit(self, entry: e.SubmitTasks) -> list[TaskRef | Rejected]:
        key = entry.idempotency_key
        if key is None:
            return [self._submit_one(spec) for spec in entry.tasks]
        problem = validate_idempotency_key(key)
        scoped = (idempotency_scope(spec.tenant for spec in entry.tasks), key)
        record = self.idempotency.get(scoped) if problem is None else None
        if problem is not None or record is not None:
            # The ids the leader stamped are used up, as a rejected spec's are.
            self.max_task_id = max([self.max_task_id, *(spec.id for spec in entry.tasks)])
            if record is None:
                return [Rejected(ErrorCode.INVALID, problem or "") for _ in entry.tasks]
            return ReplayedResults(
                TaskRef(r.task_id, r.state)
                if r.task_id is not None
                else Rejected(ErrorCode(r.state), r.message or "")
                for r in record.results
            )
        results = [self._submit_one(spec) for spec in entry.tasks]
        # A submission that created nothing is not remembered: a retry may try again
        # (e.g. once the tenant's queue has room) and still cannot duplicate anything.
        if any(isinstance(r, TaskRef) for r in results):
            self.idempotency[scoped] = SubmissionRecord(
                key,
                self.now_ms,
                [
                    RememberedResult(r.id, r.state)
                    if isinstance(r, TaskRef)
                    else RememberedResult(None, r.code.value, r.message)
                    for r in results
                ],
                scoped[0],
            )
        return results

    def _submit_one(
        self, spec: e.TaskSpec, *, root: int | None = None, parent: int | None = None
    ) -> TaskRef | Rejected:
        """Create one task: submitted (parent None) or spawned by ``parent``'s finish,
        in the tree of ``root`` when anchored there."""
        if spec.id <= self.max_task_id:
            return Rejected(ErrorCode.INVALID, f"task id {spec.id} was already used")
        self.max_task_id = spec.id
        problem = validate_task_spec(spec)
        if problem is not None:
            return Rejected(ErrorCode.INVALID, problem)
        now_ms = self.now_ms
        if spec.deadline_ms is not None and spec.deadline_ms <= now_ms:
            return Rejected(ErrorCode.INVALID, "deadline has already passed")
        txn: Transaction | None = None
        if spec.transaction is not None and parent is not None:
            return Rejected(ErrorCode.INVALID, "a spawned task cannot join a transaction")
        if spec.transaction is not None:
            txn = self._open_transaction(spec.transaction, spec.tenant)
            if txn is None:
                return Rejected(ErrorCode.NOT_FOUND, f"transaction {spec.transaction} is not open")
        if spec.code is not None and spec.code not in self.artifacts:
            return Rejected(ErrorCode.NOT_FOUND, f"code artifact {spec.code} was never uploaded")
        holder = self.slots.get((spec.tenant, spec.slot)) if spec.slot is not None else None
        if holder is not None:
            return Rejected(ErrorCode.SLOT_BUSY, f"slot {spec.slot!r} is held by task {holder}")
        tenant = self._tenant(spec.tenant)
        # Spawned children count too; _finish checks a finish's children together first,
        # so a spawn over the limit fails its parent's attempt instead of losing some.
        if tenant.max_waiting and self._queued(spec.tenant) >= tenant.max_waiting:
            return Rejected(
                ErrorCode.TENANT_QUEUE_FULL,
                f"tenant {spec.tenant!r} already has {tenant.max_waiting} queued tasks "
                "(its max_waiting)",
            )
        if txn is not None:
            state = TaskState.PENDING
        elif spec.start_after_ms is not None and spec.start_after_ms > now_ms:
            state = TaskState.DELAYED
        else:
            state = TaskState.WAITING
        task = Task(
            id=spec.id,
            type=spec.type,
            tenant=spec.tenant,
            params=spec.params,
            state=state.value,
            created_ms=now_ms,
            updated_ms=now_ms,
            slot=spec.slot,
            max_attempts=spec.max_attempts,
            deadline_ms=spec.deadline_ms,
            start_after_ms=spec.start_after_ms,
            # float(): an int from an entry object (the leader's) must store as a follower's float.
            resources={name: float(amount) for name, amount in spec.resources.items()},
            transaction=spec.transaction,
            code=spec.code,
            root=root if root is not None else spec.id if spec.track_tree else None,
            parent=parent,
        )
        check_move(None, task.state)  # created (not in _add_task: snapshot load uses it)
        self._add_task(task)
        if txn is not None:
            txn.task_ids.append(task.id)
        if root is None and spec.track_tree:
            self.trees[task.id] = TreeRecord(
                root=task.id,
                tenant=task.tenant,
                ack_val=tree_value(task.id),
                timeout_ms=spec.tree_timeout_ms,
            )
        return TaskRef(task.id, task.state)

    def _cancel(self, entry: e.CancelTask) -> TaskRef | Rejected:
        task = self.tasks.get(entry.task_id)
        if task is None:
            return Rejected(ErrorCode.NOT_FOUND, f"task {entry.task_id} does not exist")
        if task.state in FINAL_STATES:
            return Rejected(ErrorCode.CONFLICT, f"task {task.id} is already {task.state}")
        task.error = entry.reason
        self._stop_if_running(task, entry.reason)
        self._move(task, TaskState.CANCELLED)
        self._task_ended(task)
        return TaskRef(task.id, task.state)

    def _stop_if_running(self, task: Task, reason: str) -> None:
        if task.state == TaskState.RUNNING and task.worker is not None:
            self._effects.append(StopRunning(task.worker, task.id, task.attempt, reason))

    def _begin(self, entry: e.BeginTransaction) -> TransactionRef | Rejected:
        if entry.transaction_id <= self.max_transaction_id:
            return Rejected(
                ErrorCode.INVALID, f"transaction id {entry.transaction_id} was already used"
            )
        self.max_transaction_id = entry.transaction_id
        if not NAME_RE.match(entry.tenant):
            return Rejected(ErrorCode.INVALID, "tenant name is not valid")
        if entry.ttl_ms <= 0:
            return Rejected(ErrorCode.INVALID, "ttl_ms must be > 0")
        self._tenant(entry.tenant)
        txn = Transaction(
            id=entry.transaction_id,
            tenant=entry.tenant,
            created_ms=self.now_ms,
            expires_ms=self.now_ms + entry.ttl_ms,
        )
        self.transactions[txn.id] = txn
        self._push_timer(txn.expires_ms, _Timer.TXN_EXPIRE, txn.id)
        return TransactionRef(txn.id, txn.tenant, txn.expires_ms)

    def _open_transaction(self, txn_id: int, tenant: str | None) -> Transaction | None:
        """The open transaction ``txn_id`` as ``tenant`` sees it (None: any tenant's):
        another tenant's answers as one that is not open, so its existence is not shown."""
        txn = self.transactions.get(txn_id)
        if txn is None or (tenant is not None and txn.tenant != tenant):
            return None
        return txn

    def _commit(self, entry: e.CommitTransaction) -> TransactionDone | Rejected:
        txn = self._open_transaction(entry.transaction_id, entry.tenant)
        if txn is None:
            return Rejected(ErrorCode.NOT_FOUND, f"transaction {entry.transaction_id} is not open")
        del self.transactions[txn.id]
        committed: list[int] = []
        for task_id in txn.task_ids:
            task = self.tasks.get(task_id)
            if task is None or task.state != TaskState.PENDING:
                continue
            task.transaction = None
            if task.start_after_ms is not None and task.start_after_ms > self.now_ms:
                self._move(task, TaskState.DELAYED)
                self._push_timer(task.start_after_ms, _Timer.START, task.id)
            else:
                self._move(task, TaskState.WAITING)
            committed.append(task_id)
        return TransactionDone(txn.id, "committed", tuple(committed))

    def _rollback(self, entry: e.RollbackTransaction) -> TransactionDone | Rejected:
        txn = self._open_transaction(entry.transaction_id, entry.tenant)
        if txn is None:
            return Rejected(ErrorCode.NOT_FOUND, f"transaction {entry.transaction_id} is not open")
        dropped = self._drop_transaction(txn)
        return TransactionDone(txn.id, "rolled_back", tuple(dropped))

    def _drop_transaction(self, txn: Transaction) -> list[int]:
        # A rolled back (or expired) transaction's tasks never existed.
        del self.transactions[txn.id]
        dropped: list[int] = []
        for task_id in txn.task_ids:
            task = self.tasks.get(task_id)
            if task is not None and task.state == TaskState.PENDING:
                self._delete_task(task)
                dropped.append(task_id)
        return dropped

    def _set_tenant(self, entry: e.SetTenant) -> Tenant | Rejected:
        if not NAME_RE.match(entry.tenant):
            return Rejected(ErrorCode.INVALID, "tenant name is not valid")
        problem = validate_limits(entry.limits)
        if problem is not None:
            return Rejected(ErrorCode.INVALID, problem)
        tenant = self._tenant(entry.tenant)
        if entry.limits.max_waiting is not None:
            tenant.max_waiting = entry.limits.max_waiting
        if entry.limits.max_running is not None:
            tenant.max_running = entry.limits.max_running
        if entry.limits.weight is not None:
            tenant.weight = float(entry.limits.weight)
        return tenant

    def _set_config(self, entry: e.SetConfig) -> Rejected | None:
        retention_ms = entry.finished_task_retention_ms
        if retention_ms is not None and retention_ms <= 0:
            return Rejected(ErrorCode.INVALID, "finished_task_retention_ms must be > 0")
        if entry.global_limits is not None:
            for name, amount in entry.global_limits.items():
                if not NAME_RE.match(name) or not (math.isfinite(amount) and amount >= 0):
                    return Rejected(ErrorCode.INVALID, f"global limit {name!r} is not valid")
            self.config.global_limits = {n: float(v) for n, v in entry.global_limits.items()}
        if entry.finished_task_retention_ms is not None and entry.finished_task_retention_ms > 0:
            self.config.finished_task_retention_ms = entry.finished_task_retention_ms
            self._rebuild_timers()
        return None

    def _tick(self, entry: e.Tick) -> None:
        return None

    def _register_worker(self, entry: e.RegisterWorker) -> WorkerReconciled | Rejected:
        if not entry.worker_id:
            return Rejected(ErrorCode.INVALID, "worker_id must not be empty")
        if any(not (math.isfinite(a) and a >= 0) for a in entry.resources.values()) or any(
            n < 0 for n in entry.task_types.values()
        ):
            return Rejected(ErrorCode.INVALID, "worker capacities must be finite and >= 0")
        known = self.workers.get(entry.worker_id)
        if (
            known is not None
            and known.state == WorkerState.CONNECTED
            and known.credential != entry.credential
        ):
            # A worker id belongs to the credential it connected with until it is declared
            # dead: another credential must not take over its running tasks.
            return Rejected(
                ErrorCode.CONFLICT,
                f"worker id {entry.worker_id!r} is connected with another credential",
            )
        reported = {(r.task_id, r.attempt) for r in entry.running}
        keep: list[e.TaskAttempt] = []
        lost: list[int] = []
        for task_id in sorted(self.running_by_worker.get(entry.worker_id, ())):
            task = self.tasks[task_id]
            if (task.id, task.attempt) in reported:
                keep.append(e.TaskAttempt(task.id, task.attempt))
            else:
                lost.append(task.id)
        for task_id in lost:
            task = self.tasks[task_id]
            # A lost task whose tree failed because of an earlier one is already over.
            if task.state == TaskState.RUNNING and task.worker == entry.worker_id:
                self._retry_or_fail(
                    task, f"worker {entry.worker_id} came back without task {task.id}"
                )
        if len(lost):
            running = self.running_by_worker.get(entry.worker_id, set())
            keep = [k for k in keep if k.task_id in running]
        worker = self.workers.get(entry.worker_id)
        if worker is None:
            worker = self.workers[entry.worker_id] = Worker(
                id=entry.worker_id,
                address=entry.address,
                process_id=entry.process_id,
                state=WorkerState.CONNECTED.value,
                connected_ms=self.now_ms,
                updated_ms=self.now_ms,
            )
        worker.address = entry.address
        worker.process_id = entry.process_id
        worker.state = WorkerState.CONNECTED.value
        worker.connected_ms = self.now_ms
        worker.updated_ms = self.now_ms
        worker.resources = {name: float(amount) for name, amount in entry.resources.items()}
        worker.task_types = dict(entry.task_types)
        worker.tenants = list(entry.tenants)
        worker.reason = None
        worker.credential = entry.credential
        return WorkerReconciled(entry.worker_id, tuple(keep), tuple(lost))

    def _worker_dead(self, entry: e.WorkerDead) -> Rejected | None:
        worker = self.workers.get(entry.worker_id)
        if worker is None:
            return Rejected(ErrorCode.NOT_FOUND, f"worker {entry.worker_id!r} is unknown")
        if entry.connected_ms is not None and entry.connected_ms != worker.connected_ms:
            return Rejected(ErrorCode.STALE, f"worker {worker.id} registered again since")
        worker.state = WorkerState.DEAD.value
        worker.updated_ms = self.now_ms
        worker.reason = entry.reason
        for task_id in sorted(self.running_by_worker.get(worker.id, ())):
            task = self.tasks[task_id]
            if task.state != TaskState.RUNNING or task.worker != worker.id:
                continue  # cancelled or replayed meanwhile: a failed tree of an earlier one
            self._retry_or_fail(task, f"worker {worker.id} died: {entry.reason}")
        return None

    def _retry_or_fail(self, task: Task, error: str) -> None:
        task.error = error
        if task.attempt >= task.max_attempts:
            task.error = f"{error} (attempt {task.attempt} of {task.max_attempts})"
            self._move(task, TaskState.ERROR)
            self._task_ended(task)
        else:
            self._move(task, TaskState.WAITING)

    def _assign(self, entry: e.AssignTasks) -> list[TaskRef | Rejected]:
        results: list[TaskRef | Rejected] = []
        for assignment in entry.assignments:
            task = self.tasks.get(assignment.task_id)
            worker = self.workers.get(assignment.worker_id)
            if task is None or task.state != TaskState.WAITING:
                results.append(Rejected(ErrorCode.STALE, f"task {assignment.task_id} not waiting"))
            elif worker is None or worker.state != WorkerState.CONNECTED:
                results.append(
                    Rejected(ErrorCode.STALE, f"worker {assignment.worker_id} not connected")
                )
            elif self._code_blocked(task):
                results.append(
                    Rejected(
                        ErrorCode.STALE,
                        f"task {task.id} waits for code artifact {task.code} to be ready",
                    )
                )
            else:
                task.attempt += 1
                task.worker = worker.id
                self._move(task, TaskState.RUNNING)
                if task.root == task.id:
                    self._start_tree(task.id)
                results.append(TaskRef(task.id, task.state))
        return results

    def _finish(self, entry: e.FinishTasks) -> list[TaskRef | Rejected]:
        results: list[TaskRef | Rejected] = []
        for outcome in entry.outcomes:
            task = self.tasks.get(outcome.task_id)
            if (
                task is None
                or task.state != TaskState.RUNNING
                or task.worker != outcome.worker_id
                or task.attempt != outcome.attempt
            ):
                # A duplicate or late report of an attempt that is over: spawns nothing.
                self._use_ids(outcome.spawn)
                results.append(Rejected(ErrorCode.STALE, f"task {outcome.task_id} not running"))
                continue
            refusal = self._spawn_refusal(outcome.spawn) if outcome.ok else None
            if refusal is not None:
                # Nothing spawned: the attempt fails (and retries if it may), as any
                # error of the task would; the limit is read from the state being applied.
                self._use_ids(outcome.spawn)
                self._retry_or_fail(task, refusal)
            elif outcome.ok:
                task.result = outcome.result
                task.error = None
                self._move(task, TaskState.FINISHED)
                self._finished_ok(task, outcome.spawn)
            else:
                self._use_ids(outcome.spawn)
                self._retry_or_fail(task, outcome.error or "task failed")
            results.append(TaskRef(task.id, task.state))
        return results

    # --- task trees (Storm's acker) ---------------------------------------------------

    def _use_ids(self, spawn: tuple[e.Spawn, ...]) -> None:
        # Children not created still used up the ids the leader stamped for them.
        if spawn:
            self.max_task_id = max(self.max_task_id, *(s.task.id for s in spawn))

    def _spawn_refusal(self, spawn: tuple[e.Spawn, ...]) -> str | None:
        """Why a finish may not create these children: all of them would not fit in a
        tenant's max_waiting (each tenant counted once, in the children's order)."""
        if not spawn:
            return None
        counts: dict[str, int] = {}
        for child in spawn:
            counts[child.task.tenant] = counts.get(child.task.tenant, 0) + 1
        for name, count in counts.items():
            tenant = self.tenants.get(name)
            limit = tenant.max_waiting if tenant is not None else 0
            if limit and self._queued(name) + count > limit:
                return f"spawn refused: tenant {name!r} max_waiting {limit} reached"
        return None

    def _start_tree(self, root: int) -> None:
        """The root runs: its tree's timeout starts, once per run."""
        tree = self.trees.get(root)
        if tree is not None and tree.state == TreeState.PENDING and tree.deadline_ms is None:
            tree.deadline_ms = self.now_ms + tree.timeout_ms
            self._push_timer(tree.deadline_ms, _Timer.TREE_DEADLINE, root)

    def _tree_pending(self, root: int) -> bool:
        tree = self.trees.get(root)
        return tree is not None and tree.state == TreeState.PENDING

    def _finished_ok(self, task: Task, spawn: tuple[e.Spawn, ...]) -> None:
        """Create the children of a task that finished, then ack it in its tree."""
        tree = self.trees.get(task.root) if task.root is not None else None
        if tree is not None and tree.state != TreeState.PENDING:
            tree = None  # cannot happen: a failed or completed tree has no live task
        ack = tree_value(task.id) if tree is not None else 0
        failure: str | None = None
        for child in spawn:
            spec = child.task
            anchored = tree is not None and bool(child.anchors)
            if not anchored:
                # Unanchored, or anchored to an untracked task (a no-op, as in Storm).
                self._submit_one(spec, parent=task.id)
                continue
            assert tree is not None
            if failure is not None:
                self._use_ids((child,))  # the tree failed: its later children are moot
                continue
            outside = [a for a in child.anchors if not self._in_tree(a, tree.root)]
            if outside:
                self._use_ids((child,))
                failure = f"task {task.id} anchored child {spec.id} outside the tree"
                continue
            created = self._submit_one(spec, root=tree.root, parent=task.id)
            if isinstance(created, Rejected):
                failure = f"child {spec.id} of task {task.id} refused: {created.code.value}"
            else:
                ack ^= tree_value(spec.id)
        if tree is None:
            return
        tree.ack_val ^= ack  # children created and parent acked in one step, as Storm
        if failure is not None:
            self._fail_tree(tree, failure)
        elif tree.ack_val == 0:
            self._end_tree(tree, TreeState.COMPLETED)

    def _in_tree(self, task_id: int, root: int) -> bool:
        task = self.tasks.get(task_id)
        return task is not None and task.root == root

    def _task_ended(self, task: Task) -> None:
        """A tree task ended in error or was cancelled: its tree fails at once."""
        if task.root is not None:
            tree = self.trees.get(task.root)
            if tree is not None and tree.state == TreeState.PENDING:
                how = "was cancelled" if task.state == TaskState.CANCELLED else "ended in error"
                self._fail_tree(tree, f"task {task.id} {how}")

    def _fail_tree(self, tree: TreeRecord, reason: str) -> None:
        """Cancel the tree's outstanding tasks, then replay the root if attempts remain."""
        tree.state = TreeState.FAILED.value
        tree.reason = reason
        root = self.tasks[tree.root]
        why = f"tree of task {root.id} failed: {reason}"
        for task_id in sorted(self.tree_live.get(root.id, ())):
            if task_id != root.id:
                task = self.tasks[task_id]
                task.error = why
                self._stop_if_running(task, why)
                self._move(task, TaskState.CANCELLED)
        replayable = (
            root.state not in (TaskState.ERROR, TaskState.CANCELLED)
            and root.attempt < root.max_attempts
            and (root.deadline_ms is None or root.deadline_ms > self.now_ms)
            # Its slot may have gone to another task since the root finished.
            and (root.slot is None or self.slots.get((root.tenant, root.slot), root.id) == root.id)
        )
        if not replayable:
            if root.state in LIVE_STATES:
                root.error = why
                self._stop_if_running(root, why)
                self._move(root, TaskState.CANCELLED)
            self._end_tree(tree, TreeState.FAILED)
            return
        root.error = f"{why}; replayed"
        if root.state == TaskState.RUNNING:
            self._stop_if_running(root, why)
            self._move(root, TaskState.WAITING)
        elif root.state == TaskState.FINISHED:
            root.result = None
            root.finished_ms = None
            if root.slot is not None:
                self.slots[(root.tenant, root.slot)] = root.id
            self._move(root, TaskState.WAITING)
            if root.deadline_ms is not None:
                self._push_timer(root.deadline_ms, _Timer.DEADLINE, root.id)
        # A fresh run: only the root is live in the tree now.
        tree.ack_val = tree_value(root.id)
        tree.attempt += 1
        tree.deadline_ms = None  # until the root runs again
        tree.state = TreeState.PENDING.value

    def _end_tree(self, tree: TreeRecord, state: TreeState) -> None:
        tree.state = state.value
        tree.ended_ms = self.now_ms
        if state == TreeState.COMPLETED:
            tree.reason = None
        self._effects.append(TreeEnded(tree.root))
        root = self.tasks[tree.root]
        if root.finished_ms is not None and root.state in FINAL_STATES:
            # Its purge was held back while the tree was pending.
            self._push_timer(self._purge_ms(root), _Timer.PURGE, root.id)

    def _add_code(self, entry: e.AddCode) -> Artifact | Rejected:
        if not SHA256_RE.fullmatch(entry.sha256):
            return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
        if entry.size_bytes < 0:
            return Rejected(ErrorCode.INVALID, "size_bytes must be >= 0")
        if entry.tenant is not None and not NAME_RE.match(entry.tenant):
            return Rejected(ErrorCode.INVALID, f"tenant name {entry.tenant!r} is not valid")
        artifact = self.artifacts.get(entry.sha256)
        if artifact is None:
            artifact = self.artifacts[entry.sha256] = Artifact(
                entry.sha256,
                entry.name,
                entry.size_bytes,
                self.now_ms,
                entry.ready,
                [entry.tenant] if entry.tenant is not None else [],
            )
        else:
            if entry.ready and not artifact.ready:
                # Uploaded again by a leader that needs no replicas first: no reason to wait.
                self._release_code(artifact)
            if entry.tenant is None:
                if artifact.owners:
                    # An admin upload shares it with every tenant: they are shown the
                    # admin's name and time, not those of the tenant that uploaded first.
                    artifact.name, artifact.created_ms = entry.name, self.now_ms
                artifact.owners = []
            elif artifact.owners and entry.tenant not in artifact.owners:
                artifact.owners = sorted([*artifact.owners, entry.tenant])
        if entry.tenant is not None and artifact.upload_of(entry.tenant) is None:
            artifact.uploads.append(ArtifactUpload(entry.tenant, entry.name, self.now_ms))
        return artifact

    def _create_token(self, entry: e.CreateToken) -> ApiToken | Rejected:
        if not re.fullmatch(r"[0-9a-f]{1,64}", entry.token_id):
            return Rejected(ErrorCode.INVALID, "token_id must be 1 to 64 lowercase hex digits")
        if not SHA256_RE.fullmatch(entry.sha256):
            return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
        problem = validate_token_fields(entry.name, entry.role, entry.tenant, entry.tenants)
        if problem is not None:
            return Rejected(ErrorCode.INVALID, problem)
        if entry.token_id in self.tokens or entry.sha256 in self.token_ids_by_hash:
            return Rejected(ErrorCode.CONFLICT, f"token {entry.token_id} already exists")
        token = ApiToken(
            entry.token_id,
            entry.name,
            entry.role,
            entry.tenant,
            entry.sha256,
            self.now_ms,
            tenants=list(entry.tenants),
        )
        self.tokens[token.id] = token
        self.token_ids_by_hash[token.sha256] = token.id
        return token

    def _revoke_token(self, entry: e.RevokeToken) -> ApiToken | Rejected:
        token = self.tokens.pop(entry.token_id, None)
        if token is None:
            return Rejected(ErrorCode.NOT_FOUND, f"token {entry.token_id} does not exist")
        del self.token_ids_by_hash[token.sha256]
        return token

    def _code_ready(self, entry: e.CodeReady) -> Artifact | Rejected:
        if not SHA256_RE.fullmatch(entry.sha256):
            return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
        artifact = self.artifacts.get(entry.sha256)
        if artifact is None:
            return Rejected(ErrorCode.NOT_FOUND, f"code artifact {entry.sha256} is unknown")
        if not artifact.ready:
            self._release_code(artifact)
        return artifact

    def _release_code(self, artifact: Artifact) -> None:
        """Mark an artifact ready; its parked tasks join their queues, in id order."""
        artifact.ready = True
        parked = self.parked.pop(artifact.sha256, None)
        if parked:
            tasks = self.tasks
            for task_id in sorted(parked):
                task = tasks[task_id]
                self.waiting.setdefault(task.tenant, {})[task_id] = None

    def tree(self, task_id: int) -> TreeRecord | None:
        """The tree record of a tracked root (None for other tasks)."""
        return self.trees.get(task_id)

    # --- queries (read-only) ---------------------------------------------------------

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

    # --- snapshots and digest ----------------------------------------------------------

    def snapshot_body(self) -> SnapshotBody:
        return SnapshotBody(
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
        )

    def encode_snapshot(self) -> bytes:
        return _snapshot_encoder.encode(self.snapshot_body())

    def digest(self) -> str:
        return hashlib.sha256(self.encode_snapshot()).hexdigest()

    @classmethod
    def from_snapshot(cls, data: bytes) -> StateMachine:
        body = _snapshot_decoder.decode(data)
        if body.format_version != SNAPSHOT_BODY_VERSION:
            raise ValueError(f"unsupported snapshot body version {body.format_version}")
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

    # --- invariants (simulation tests and debug mode) ---------------------------------------

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
                    if worker is None or worker.state != WorkerState.CONNECTED:
                        fail(f"task {task.id} runs on a worker that is not connected")
                if not 1 <= task.attempt <= task.max_attempts:
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
        waiting_total = sum(len(q) for q in self.waiting.values())
        parked_total = sum(len(p) for p in self.parked.values())
        if waiting_total + parked_total != len(self.by_state[TaskState.WAITING]):
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
        self._check_tree_invariants(fail)

    def _check_tree_invariants(self, fail: Callable[[str], None]) -> None:
        # O(tasks): recompute each tree's live members and the XOR of their values.
        live: dict[int, set[int]] = {}
        xor: dict[int, int] = {}
        for task in self.tasks.values():
            if task.root is None or task.state not in LIVE_STATES:
                continue
            live.setdefault(task.root, set()).add(task.id)
            xor[task.root] = xor.get(task.root, 0) ^ tree_value(task.id)
        if live != self.tree_live:
            fail("tree_live index differs from the live tasks of trees")
        for root_id, tree in self.trees.items():
            root = self.tasks.get(root_id)
            if tree.root != root_id or root is None or root.root != root_id:
                fail(f"tree record {tree.root} kept under {root_id} or without its root task")
            elif root.tenant != tree.tenant:
                fail(f"tree {root_id} of tenant {tree.tenant!r}, root's is {root.tenant!r}")
            if tree.state == TreeState.PENDING:
                if tree.ack_val != xor.get(root_id, 0):
                    fail(f"tree {root_id} ack val differs from the XOR of its live tasks")
                if tree.ack_val == 0:
                    fail(f"tree {root_id} is pending with ack val 0")
            elif root_id in live:
                fail(f"tree {root_id} is {tree.state} but tasks {sorted(live[root_id])} live")
            if not 0 <= tree.ack_val <= _MASK64 or tree.attempt < 1:
                fail(f"tree {root_id} ack val or attempt out of range")
        for root_id in live:
            if root_id not in self.trees:
                fail(f"live tasks of tree {root_id} that has no record")
