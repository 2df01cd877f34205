"""The state machine's data: task, tenant, worker, transaction, artifact and token
records, the results ``apply`` returns, and the remembered idempotency submissions.

Pure like the state machine (no IO, no clock); ``broker/core/state.py`` re-exports every
name, so other modules import them from one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Final

import msgspec

from broker.core import entries as e
from broker.core.transitions import TaskState

LIVE_STATES: Final = frozenset(
    {TaskState.PENDING, TaskState.DELAYED, TaskState.WAITING, TaskState.RUNNING}
)
FINAL_STATES: Final = frozenset({TaskState.FINISHED, TaskState.ERROR, TaskState.CANCELLED})
# States that count against a tenant's max_waiting.
QUEUED_STATES: Final = frozenset({TaskState.PENDING, TaskState.DELAYED, TaskState.WAITING})


class WorkerState(StrEnum):
    CONNECTED = "connected"
    # Its connection closed; not yet judged dead, not assigned to (docs/DESIGN.md §8,
    # "Closed connections"). Snapshot body version 4.
    DISCONNECTED = "disconnected"
    DEAD = "dead"


#: Worker states whose running tasks stay running: a worker not (yet) judged dead.
TASK_HOLDING_WORKER_STATES: Final = frozenset({WorkerState.CONNECTED, WorkerState.DISCONNECTED})


class ErrorCode(StrEnum):
    INVALID = "invalid"
    NOT_FOUND = "not_found"
    SLOT_BUSY = "slot_busy"
    TENANT_QUEUE_FULL = "tenant_queue_full"
    CONFLICT = "conflict"
    STALE = "stale"


class Task(msgspec.Struct, array_like=True, gc=False):
    id: int
    type: str
    tenant: str
    params: bytes
    state: str
    created_ms: int
    updated_ms: int
    slot: str | None = None
    max_attempts: int = 1
    attempt: int = 0
    deadline_ms: int | None = None
    start_after_ms: int | None = None
    resources: dict[str, float] = {}
    transaction: int | None = None
    code: str | None = None
    worker: str | None = None
    result: bytes | None = None
    error: str | None = None
    finished_ms: int | None = None
    # Task trees: the root of the tracked tree this task belongs to (its own id for a
    # root) and the task whose finish spawned it. Last, so older snapshots still decode.
    root: int | None = None
    parent: int | None = None
    # Attempts given back by a stopping worker or broker (docs/DESIGN.md §6, "Stopping"):
    # not counted against max_attempts. Last, so older snapshots still decode.
    released: int = 0
    # Dependencies (docs/DESIGN.md §2, "Dependencies"): the tasks it was submitted to run
    # after (or, spawned, the other anchors of its join), and those of them not finished
    # yet; while any is left a waiting task is outside the run queues. Last, so older
    # snapshots still decode.
    after: list[int] = []
    waiting_for: list[int] = []
    # Scheduling order within the tenant and retry backoff (TaskSpec's fields); last, so
    # older snapshots still decode.
    priority: int = 0
    retry_backoff_ms: int = 0
    retry_backoff_max_ms: int = 3_600_000
    # Attempts lost with their worker (it died, or came back without the task), which
    # max_attempts does not count, and how many it may lose before it fails
    # (docs/DESIGN.md §6, "Lost workers"). Last, so older snapshots still decode.
    lost: int = 0
    max_lost: int = e.DEFAULT_MAX_LOST
    # When the current (or last) attempt started running, and how long it had waited
    # before, since it last became waiting (docs/API.md, "Task times"). Recorded by entries
    # of format 5 on (entries.STARTS_RECORDED_VERSION): None for an attempt an older entry
    # started, as in the snapshots of the time. Last, so older snapshots still decode.
    started_ms: int | None = None
    queued_ms: int | None = None

    def counted_attempts(self) -> int:
        """Attempts that count against ``max_attempts`` (given-back and lost ones do not)."""
        return self.attempt - self.released - self.lost


class TreeState(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class TreeRecord(msgspec.Struct, array_like=True, gc=False):
    """Storm's acker entry for one tracked root: a fixed size whatever the tree's size."""

    root: int
    tenant: str
    # XOR of tree_value(id) of every task created in the current run of the tree and,
    # again, of every one finished successfully: 0 exactly when all are done.
    ack_val: int
    timeout_ms: int
    # Set when the root starts running in this run (time in a queue is not processing;
    # and so every replay uses up an attempt of the root): None before.
    deadline_ms: int | None = None
    attempt: int = 1  # run of the tree, + 1 at each replay
    state: str = TreeState.PENDING.value
    reason: str | None = None  # why the (last) run failed
    # When it completed or failed for good: the root is kept as long after this as
    # after its own finish, so that its tree's outcome can be read.
    ended_ms: int | None = None


_MASK64: Final = (1 << 64) - 1


def tree_value(task_id: int) -> int:
    """The 64-bit value a task contributes to its root's ack val: splitmix64 of its id.

    Deterministic on every replica (never Python's hash), well spread so that a
    partial XOR returns to 0 only by a 2**-64 accident; never 0 itself.
    """
    z = (task_id + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) or 1


class Webhook(msgspec.Struct, array_like=True, gc=False):
    """A tenant's webhook (docs/API.md, Webhooks): where its completion events are POSTed,
    the key they are signed with, and the key of the last event delivered (the leader
    delivers the events after it)."""

    url: str
    secret: str
    delivered: tuple[int, int, int]


class Tenant(msgspec.Struct, array_like=True, gc=False):
    name: str
    max_waiting: int = 0  # 0: unlimited
    max_running: int = 0  # 0: unlimited
    weight: float = 1.0
    # Submit rate limit (tasks/s, 0: none) and its burst (0: one second's worth); last,
    # so older snapshots still decode.
    submit_rate: float = 0.0
    submit_burst: int = 0
    # Last, so older snapshots still decode.
    webhook: Webhook | None = None


class Transaction(msgspec.Struct, array_like=True, gc=False):
    id: int
    tenant: str
    created_ms: int
    expires_ms: int
    task_ids: list[int] = []


class Worker(msgspec.Struct, array_like=True, gc=False):
    id: str
    address: str
    process_id: str
    state: str
    connected_ms: int
    updated_ms: int
    resources: dict[str, float] = {}
    task_types: dict[str, int] = {}
    tenants: list[str] = []
    reason: str | None = None
    # The API worker credential (token id) it registered with; None: the shared worker
    # token. Binds the worker id to that credential while connected (apply refuses
    # another) and scopes the credential's artifact downloads (broker/api/handlers_code.py).
    credential: str | None = None
    # State time since which it has been silent to the leaders (a WorkerSilent entry; the
    # earliest kept): a new leader judges it from then (docs/DESIGN.md §8, "Silence across
    # leader changes"); a disconnected worker's is its last frame. None: not known
    # silent; a registration or its death clears it.
    silent_since_ms: int | None = None
    # It listed the task types it serves at its last registration (an older worker does not:
    # while it lives, its tenants' submits are not checked; docs/DESIGN.md §6, "Served task
    # types").
    lists_task_names: bool = False


class ArtifactUpload(msgspec.Struct, array_like=True, gc=False):
    """One tenant's first upload of an artifact: what that tenant is shown, so that the
    answer to its upload does not depend on whether another tenant sent the same bytes."""

    tenant: str
    name: str
    created_ms: int


class Artifact(msgspec.Struct, array_like=True, gc=False):
    sha256: str
    name: str
    size_bytes: int
    created_ms: int
    # False until CodeReady: tasks using it stay waiting, outside the scheduler's queues.
    ready: bool = True
    # Tenants that uploaded it (authentication on); empty: shared, usable by every tenant.
    owners: list[str] = []
    # Each uploading tenant's own name and time, in upload order (the default reads older
    # snapshots); ``name`` and ``created_ms`` above are the first or the shared upload's.
    uploads: list[ArtifactUpload] = []
    # When the last task that needed it (a live task using it) ended; 0: none yet. With
    # created_ms, what code retention measures (the default reads older snapshots).
    last_used_ms: int = 0

    def upload_of(self, tenant: str) -> ArtifactUpload | None:
        for upload in self.uploads:
            if upload.tenant == tenant:
                return upload
        return None


class ApiToken(msgspec.Struct, array_like=True, gc=False):
    """An API token issued through the API; only its SHA-256 is kept (broker/security/auth.py)."""

    id: str
    name: str
    role: str  # "tenant" | "admin" | "worker"
    tenant: str | None
    sha256: str
    created_ms: int
    # A worker credential's tenants: its workers serve these only (empty: every tenant).
    tenants: list[str] = []


class Config(msgspec.Struct):
    finished_task_retention_ms: int = 24 * 3600 * 1000
    # Cluster-wide caps on named resources summed over running tasks (e.g. a
    # licence count); resources not listed are bounded by workers only.
    global_limits: dict[str, float] = {}


# --- apply results ---------------------------------------------------------


class Rejected(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str


class TaskRef(msgspec.Struct, frozen=True):
    id: int
    state: str


class TransactionRef(msgspec.Struct, frozen=True):
    id: int
    tenant: str
    expires_ms: int


class TransactionDone(msgspec.Struct, frozen=True):
    id: int
    outcome: str  # "committed" | "rolled_back"
    task_ids: tuple[int, ...]


class ReplayedResults(list[TaskRef | Rejected]):
    """A SubmitTasks result replayed for an idempotency key already used: the
    first submission's results (same ids); nothing was created this time."""

    __slots__ = ()


class CancelCount(msgspec.Struct, frozen=True):
    """What one CancelTasks batch did: tasks cancelled, and ids skipped (already final,
    unknown, or another tenant's)."""

    cancelled: int
    skipped: int


class WorkerReconciled(msgspec.Struct, frozen=True):
    worker_id: str
    keep: tuple[e.TaskAttempt, ...]  # reported tasks still running on it
    lost: tuple[int, ...]  # tasks it no longer runs: re-queued or failed


class StopRunning(msgspec.Struct, frozen=True, gc=False):
    """A running task was ended by the broker (cancel, deadline): tell its worker."""

    worker_id: str
    task_id: int
    attempt: int
    reason: str


ApplyResult = (
    list[TaskRef | Rejected]
    | TaskRef
    | TransactionRef
    | TransactionDone
    | Tenant
    | WorkerReconciled
    | Artifact
    | ApiToken
    | CancelCount
    | Rejected
    | None
)


class RememberedResult(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One item of a remembered submission result."""

    task_id: int | None  # None: this item was rejected
    state: str  # the task's state when created, or the rejection's ErrorCode
    message: str | None = None  # the rejection's message


class SubmissionRecord(msgspec.Struct, array_like=True, gc=False):
    """What the first SubmitTasks with an idempotency key returned."""

    key: str
    created_ms: int
    results: list[RememberedResult]
    # The key's namespace: idempotency_scope() of the submission. None only in snapshots
    # written before keys were scoped (from_snapshot fills it in).
    scope: str | None = None


def idempotency_scope(tenants: Iterable[str]) -> str:
    """The namespace of a submission's idempotency key: its tenant; for an admin's batch
    mixing tenants, their sorted names joined by "," (never a tenant name: NAME_RE)."""
    return ",".join(sorted(set(tenants)))


class InvariantError(AssertionError):
    pass


# --- schedules (the handlers and the cron rules: broker/core/schedules.py) ---

#: A skip schedule's tick that the leader reaches later than this is skipped (default).
DEFAULT_GRACE_MS: Final = 60_000


class Missed(StrEnum):
    """What happens to ticks that passed while no leader fired them."""

    SKIP = "skip"  # run only a tick reached within grace_ms of its time; drop the rest
    RUN_ONCE = "run_once"  # several missed ticks run once (as the latest of them)
    RUN_ALL = "run_all"  # every missed tick runs, at most MAX_CATCH_UP of them


class Firing(msgspec.Struct, array_like=True, gc=False):
    tick_ms: int
    task_id: int | None  # None: the tick ran no task (skipped, or its submit was refused)


class Schedule(msgspec.Struct, omit_defaults=True):
    tenant: str
    name: str
    task: e.TaskSpec  # id 0: each firing gets the id its entry carries
    next_ms: int  # the next tick not yet handled
    anchor_ms: int  # interval ticks are anchor_ms + k * interval_ms
    created_ms: int
    interval_ms: int | None = None
    cron: str | None = None
    missed: str = Missed.SKIP.value
    grace_ms: int = DEFAULT_GRACE_MS
    runs: int = 0  # tasks created
    skipped: int = 0  # ticks that created no task
    last_error: str | None = None  # why the last refused firing created no task
    history: list[Firing] = []
    # State time it was paused at (None: not paused): a paused schedule fires nothing
    # (docs/DESIGN.md §6, "Periodic tasks"). Snapshot body version 3.
    paused_ms: int | None = None
