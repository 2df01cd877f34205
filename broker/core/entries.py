"""Log entries: the only module that encodes or decodes them.

Every entry is a msgpack map with a ``type`` tag and a format version ``v``.
Everything an entry needs to be applied deterministically (ids, the leader's
clock) travels inside it: ``apply`` never consults a clock or a random source.

Task params and results are carried as raw JSON text (bytes): the state
machine never looks inside them, so they are stored and served verbatim.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Final

import msgspec

#: Highest entry format version this code can apply. A broker that meets a
#: newer entry must stop rather than skip it (skipping would fork the state).
#: 2: TaskOutcome.released (an attempt given back, docs/DESIGN.md §6, "Stopping").
#: 3: TaskSpec.after and joins (a spawned child waits for its other anchors, docs/DESIGN.md §2);
#:    TaskSpec.priority and retry backoff (§6, "Priorities and backoff"); a tenant's submit rate;
#:    the entry types DeleteCode, CreateSchedule, DeleteSchedule, FireSchedule, CancelTasks,
#:    SetWebhook and WebhookProgress (each type's ``min_version``).
#: 4: the entry types WorkerSilent (a worker's silence survives a leader change,
#:    docs/DESIGN.md §8, "Silence across leader changes") and PauseSchedule (§6,
#:    "Periodic tasks").
#: 5: lost attempts (docs/DESIGN.md §6, "Lost workers"): a WorkerDead or RegisterWorker
#:    written at 5 ends its worker's running attempts as lost (TaskSpec.max_lost bounds them,
#:    max_attempts does not count them); TaskSpec.max_lost. AssignTasks, and SubmitTasks
#:    that place tasks, record when each attempt started and how long it was queued
#:    (Task.started_ms and queued_ms; docs/API.md, "Task times"). The entry type
#:    WorkerDisconnected (a closed connection shows at once, docs/DESIGN.md §8, "Closed
#:    connections"). RegisterWorker.task_names (the task types a worker serves,
#:    docs/DESIGN.md §6, "Served task types").
ENTRY_FORMAT_VERSION: Final = 5
#: The version entries are written with unless they need a newer one, so a broker not
#: yet upgraded keeps following until a newer feature is actually used.
BASE_ENTRY_FORMAT_VERSION: Final = 1
#: The format from which a worker's death or return ends its attempts as lost, not counted
#: against max_attempts (docs/DESIGN.md §6, "Lost workers"). ``apply`` keys the rule on the
#: entry's version, so an older leader's entries apply as that leader applied them.
LOST_ATTEMPTS_VERSION: Final = 5
#: Default of TaskSpec.max_lost: attempts a task may lose with its worker before it fails.
DEFAULT_MAX_LOST: Final = 3
#: The version from which an entry that starts attempts records their start: an older one
#: did not, and replaying it must give the state a snapshot of its time holds (no start).
STARTS_RECORDED_VERSION: Final = 5
#: The version of a RegisterWorker listing its worker's task types (``task_names``): an older
#: broker would drop them and so fork its record of served types.
SERVED_TYPES_VERSION: Final = 5

#: A code artifact's name: the sha256 of its bytes as 64 lowercase hex digits (use fullmatch).
#: Here, with the entries that carry such names, so the state machine checks them without
#: importing the artifact store (an IO module).
SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")


class EntryDecodeError(Exception):
    """Bytes that are not a valid log entry of a supported version."""


class NewerEntryFormatError(EntryDecodeError):
    """An entry written by a newer release: this broker must stop, and be upgraded."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(
            f"log entry format version {version} is newer than this broker's "
            f"{ENTRY_FORMAT_VERSION}: upgrade the broker to a release that reads version "
            f"{version}"
        )


class _VersionProbe(msgspec.Struct):
    """Only the version, read when the full decode fails: a newer entry (say, of a type this
    code does not know) is then reported as a version problem, not as garbage."""

    v: int = BASE_ENTRY_FORMAT_VERSION


class _Entry(msgspec.Struct, tag_field="type", omit_defaults=True, frozen=True):
    # The oldest format whose readers know this entry type: encode_entry writes the entry
    # in it at least, so an older broker refuses it naming the version instead of failing
    # on an unknown type tag (docs/OPERATIONS.md, "Rolling upgrade"). Not encoded.
    min_version: ClassVar[int] = BASE_ENTRY_FORMAT_VERSION
    # Leader's clock when the entry was created; apply() advances time with it.
    time_ms: int
    v: int = BASE_ENTRY_FORMAT_VERSION


class TaskSpec(msgspec.Struct, omit_defaults=True, frozen=True, gc=False):
    """One task as submitted, with the id the leader chose for it."""

    id: int
    type: str
    tenant: str
    params: bytes = b"null"  # raw JSON text
    slot: str | None = None
    max_attempts: int = 1
    deadline_ms: int | None = None
    start_after_ms: int | None = None
    resources: dict[str, float] = {}
    transaction: int | None = None
    code: str | None = None
    # Storm's guaranteed processing: this task roots a tree whose completion is tracked
    # (False, Storm's "no message id", keeps the plain task of older entries).
    track_tree: bool = False
    # The tree fails when not complete this long after the root's (re)start; like
    # Storm's TOPOLOGY_MESSAGE_TIMEOUT_SECS default.
    tree_timeout_ms: int = 30_000
    # Tasks this one waits for: it runs once every one of them finished, and fails when
    # one ends in error or is cancelled (docs/DESIGN.md §2, "Dependencies"). Last, so
    # older entries still decode.
    after: tuple[int, ...] = ()
    # Higher first within its tenant (FIFO within a priority); last, so older entries
    # still decode. Entries using them are written as version 3 (submit_version).
    priority: int = 0
    # The delay before retry n is retry_backoff_ms * 2^(n-1), capped by
    # retry_backoff_max_ms, +-25% deterministic jitter (broker/core/backoff.py); 0: none.
    retry_backoff_ms: int = 0
    retry_backoff_max_ms: int = 3_600_000
    # Attempts it may lose with its worker (dead, or back without it) before it fails;
    # they do not count against max_attempts (docs/DESIGN.md §6, "Lost workers"). Last, so
    # older entries still decode; a spec that changes it is written as version 5.
    max_lost: int = DEFAULT_MAX_LOST


#: Default of TaskSpec.retry_backoff_max_ms.
DEFAULT_RETRY_BACKOFF_MAX_MS: Final = 3_600_000

#: Default of TaskSpec.tree_timeout_ms.
DEFAULT_TREE_TIMEOUT_MS: Final = 30_000


class Spawn(msgspec.Struct, omit_defaults=True, frozen=True, gc=False):
    """A child task created by its parent's successful finish (same entry, so a parent
    that crashes spawns nothing twice). ``anchors``: task ids of the parent's tree the
    child hangs from (several make a DAG); none: the child is not tracked."""

    task: TaskSpec
    anchors: tuple[int, ...] = ()


class Assignment(msgspec.Struct, frozen=True, array_like=True):
    task_id: int
    worker_id: str


class SubmitTasks(_Entry, frozen=True, tag="submit"):
    tasks: tuple[TaskSpec, ...] = ()
    # A client's retry with the same key replays the first result instead of
    # creating tasks again (None, the default, keeps old entries valid).
    idempotency_key: str | None = None
    # Tasks of this entry the leader placed on free worker slots as it built the entry
    # (no task of any tenant was waiting): apply starts them if its own checks agree, else
    # they wait for the scheduler (docs/DESIGN.md §6). Empty, the default, keeps old
    # entries valid.
    assignments: tuple[Assignment, ...] = ()


def submit_version(tasks: tuple[TaskSpec, ...], assignments: tuple[Assignment, ...] = ()) -> int:
    """The oldest entry format that holds these specs: 3 with dependencies, a priority or
    a backoff, 5 with a max_lost other than the default, or when it places tasks (their
    start is recorded, STARTS_RECORDED_VERSION): an older broker would silently ignore
    them and so fork the state."""
    if assignments:
        return STARTS_RECORDED_VERSION
    if any(t.max_lost != DEFAULT_MAX_LOST for t in tasks):
        return LOST_ATTEMPTS_VERSION
    if any(t.after or t.priority or t.retry_backoff_ms for t in tasks):
        return 3
    return BASE_ENTRY_FORMAT_VERSION


class CancelTask(_Entry, frozen=True, tag="cancel"):
    task_id: int = 0
    reason: str = "cancelled by request"


#: At most this many task ids in one CancelTasks entry (a bulk cancel logs several).
MAX_CANCEL_BATCH: Final = 1000


class CancelTasks(_Entry, frozen=True, tag="cancel_many"):
    """One bounded batch of a cancel by filter (the leader chose the ids): tasks already
    final, unknown or (with ``tenant``) of another tenant are skipped, not refused.
    Written as format 3 (``min_version``): a broker older than this entry type stops,
    naming the version."""

    min_version: ClassVar[int] = 3

    task_ids: tuple[int, ...] = ()
    reason: str = "cancelled by request"
    tenant: str | None = None  # only this tenant's tasks (None: any, an admin's request)


class BeginTransaction(_Entry, frozen=True, tag="txn_begin"):
    transaction_id: int = 0
    tenant: str = ""
    ttl_ms: int = 60_000


class CommitTransaction(_Entry, frozen=True, tag="txn_commit"):
    transaction_id: int = 0
    # The tenant asking: another tenant's transaction is "not open" to it (None: any
    # tenant's, an admin's request or an entry written before transactions were scoped).
    tenant: str | None = None


class RollbackTransaction(_Entry, frozen=True, tag="txn_rollback"):
    transaction_id: int = 0
    tenant: str | None = None  # as CommitTransaction.tenant


class TenantLimitsPatch(msgspec.Struct, omit_defaults=True, frozen=True):
    """Fields left as None keep their current value."""

    max_waiting: int | None = None
    max_running: int | None = None
    weight: float | None = None
    # Submissions per second the leader accepts from the tenant, with a burst (0:
    # unlimited; entry format 3, docs/DESIGN.md §6, "Submit rate limit").
    submit_rate: float | None = None
    submit_burst: int | None = None


class SetTenant(_Entry, frozen=True, tag="tenant_set"):
    tenant: str = ""
    limits: TenantLimitsPatch = TenantLimitsPatch()


class SetConfig(_Entry, frozen=True, tag="config_set"):
    finished_task_retention_ms: int | None = None
    global_limits: dict[str, float] | None = None  # replaces the whole map when given


class Tick(_Entry, frozen=True, tag="tick"):
    """Advances the replicated clock (timers fire) and marks the writer's LAC when idle."""


class TaskAttempt(msgspec.Struct, frozen=True, array_like=True):
    task_id: int
    attempt: int


class RegisterWorker(_Entry, frozen=True, tag="worker_register"):
    """A worker (re)connected. Tasks the state has running on it that it does
    not report in ``running`` were lost (it restarted): they are re-queued."""

    worker_id: str = ""
    address: str = ""
    process_id: str = ""
    resources: dict[str, float] = {}
    task_types: dict[str, int] = {}  # capacity per task type ("*" for any)
    tenants: tuple[str, ...] = ()  # empty: serves every tenant
    running: tuple[TaskAttempt, ...] = ()
    # The id of the API worker credential it authenticated with; None: the shared
    # worker token (or authentication off).
    credential: str | None = None
    # The task type names the worker can run (its registry); None: not listed (an older
    # worker, or one over the cap). Written as SERVED_TYPES_VERSION (register_version).
    task_names: tuple[str, ...] | None = None


def lost_attempts_version(loses_attempts: bool) -> int:
    """The format of a WorkerDead or RegisterWorker entry that, in the leader's state as it
    builds the entry, ``loses_attempts`` (its worker runs tasks it dies with, or comes back
    without): 5, so they end as lost (docs/DESIGN.md §6, "Lost workers"); else the oldest."""
    return LOST_ATTEMPTS_VERSION if loses_attempts else BASE_ENTRY_FORMAT_VERSION


def register_version(loses_attempts: bool, task_names: tuple[str, ...] | None) -> int:
    """The format of a RegisterWorker: lost_attempts_version's, and at least
    SERVED_TYPES_VERSION when it lists its worker's task types."""
    version = lost_attempts_version(loses_attempts)
    return version if task_names is None else max(version, SERVED_TYPES_VERSION)


class WorkerDead(_Entry, frozen=True, tag="worker_dead"):
    worker_id: str = ""
    reason: str = "heartbeat deadline missed"
    # The registration the leader judged dead; a later re-registration wins.
    connected_ms: int | None = None


class SilentWorker(msgspec.Struct, frozen=True, array_like=True):
    """A connected worker silent to the leader since ``since_ms`` (state time), as
    registered at ``connected_ms`` (a later registration wins, as for WorkerDead);
    ``since_ms`` None: heard again on its connection, the silence is over."""

    worker_id: str
    since_ms: int | None
    connected_ms: int


#: At most this many workers in one WorkerSilent entry (a takeover logs several).
MAX_SILENT_BATCH: Final = 1000


class WorkerSilent(_Entry, frozen=True, tag="worker_silent"):
    """Workers the state counts connected that have been silent to the leader for half the
    heartbeat timeout (docs/DESIGN.md §8, "Silence across leader changes"): each keeps the
    earliest ``since_ms`` on its record until it registers again or is declared dead, so a
    new leader judges it from then, not from its own start. Written as format 4."""

    min_version: ClassVar[int] = 4

    workers: tuple[SilentWorker, ...] = ()


class DisconnectedWorker(msgspec.Struct, frozen=True, array_like=True):
    """A worker whose connection to the leader closed, as registered at ``connected_ms`` (a
    later registration wins, as for WorkerDead); ``last_seen_ms``: its last frame, in state
    time (the heartbeat timeout runs from then)."""

    worker_id: str
    last_seen_ms: int
    connected_ms: int


#: At most this many workers in one WorkerDisconnected entry.
MAX_DISCONNECTED_BATCH: Final = 1000


class WorkerDisconnected(_Entry, frozen=True, tag="worker_disconnected"):
    """Connected workers whose connection to the leader closed (docs/DESIGN.md §8, "Closed
    connections"): each is ``disconnected`` (assigned nothing; its running tasks stay
    running, presumed lost) until it registers again or the heartbeat timeout, counted from
    its last frame, declares it dead. Written as format 5."""

    min_version: ClassVar[int] = 5

    workers: tuple[DisconnectedWorker, ...] = ()


class AssignTasks(_Entry, frozen=True, tag="assign"):
    """Attempts the leader starts. Written as version STARTS_RECORDED_VERSION (``v`` set
    by the leader, not ``min_version``: an older entry, logged without ``v``, must still
    read as the version it was written in)."""

    assignments: tuple[Assignment, ...] = ()


class TaskOutcome(msgspec.Struct, omit_defaults=True, frozen=True):
    task_id: int
    worker_id: str
    attempt: int
    ok: bool
    result: bytes | None = None  # raw JSON text when ok
    error: str | None = None  # message and traceback when not ok
    # Children to create with this (successful) finish; ids stamped by the leader.
    spawn: tuple[Spawn, ...] = ()
    # Not ok because the worker or broker stops: the task waits again, the attempt is not
    # counted, and the worker is assigned nothing more (docs/DESIGN.md §6, "Stopping").
    released: bool = False


class FinishTasks(_Entry, frozen=True, tag="finish"):
    outcomes: tuple[TaskOutcome, ...] = ()


def finish_tasks(time_ms: int, outcomes: tuple[TaskOutcome, ...]) -> FinishTasks:
    """A FinishTasks entry in the oldest format that holds its outcomes: version 2 with
    a given-back one (an older broker would apply it as a failure)."""
    version = 2 if any(o.released for o in outcomes) else BASE_ENTRY_FORMAT_VERSION
    # A child anchored to another task than its parent is a join (it waits): an older
    # broker would start it at once, so such a finish needs version 3.
    if any(a != o.task_id for o in outcomes for s in o.spawn for a in s.anchors):
        version = 3
    # A child with its own max_lost: an older broker would drop it.
    if any(s.task.max_lost != DEFAULT_MAX_LOST for o in outcomes for s in o.spawn):
        version = LOST_ATTEMPTS_VERSION
    return FinishTasks(time_ms=time_ms, outcomes=outcomes, v=version)


class AddCode(_Entry, frozen=True, tag="code_add"):
    """A code artifact was stored by the leader (content-addressed)."""

    sha256: str = ""
    name: str = ""
    size_bytes: int = 0
    # False when the leader wants more replicas first (docs/DESIGN.md §7): tasks using it wait
    # until a CodeReady entry. The default keeps entries written before the flag valid.
    ready: bool = True
    # The tenant that uploaded it, when authentication is on (None: an admin upload or
    # no authentication): tenants see and use only their own artifacts and shared ones.
    tenant: str | None = None


class CodeReady(_Entry, frozen=True, tag="code_ready"):
    """An artifact logged with ``ready=False`` may now run: it reached its replication
    target, or the leader stopped waiting for it (max_replication_wait)."""

    sha256: str = ""


class DeleteCode(_Entry, frozen=True, tag="code_delete"):
    """An artifact is deleted (docs/DESIGN.md §7): every broker removes its file once
    applied. ``tenant`` None is an admin's delete (or no authentication); a tenant's
    delete of an artifact other tenants also uploaded only drops that tenant's claim.
    ``unused_for_ms`` > 0 is the leader's retention: applied only if no task has needed
    the artifact for that long (re-checked here, so a task submitted meanwhile wins)."""

    min_version: ClassVar[int] = 3

    sha256: str = ""
    tenant: str | None = None
    unused_for_ms: int = 0


class CreateToken(_Entry, frozen=True, tag="token_create"):
    """An API token was issued. Only the SHA-256 of its secret is logged; the id and the
    hash come from the leader's API handler, so every replica stores the same record."""

    token_id: str = ""
    name: str = ""
    role: str = "tenant"  # "tenant" | "admin" | "worker"
    tenant: str | None = None  # the tenant a tenant token acts for
    sha256: str = ""
    # A worker credential: the tenants its workers may serve (empty: every tenant).
    tenants: tuple[str, ...] = ()


class RevokeToken(_Entry, frozen=True, tag="token_revoke"):
    token_id: str = ""


class CreateSchedule(_Entry, frozen=True, tag="schedule_create"):
    """A periodic task (broker/core/schedules.py): ``task`` (id 0) is created at each tick
    of ``cron`` (UTC) or every ``interval_ms``; the leader computed ``first_ms``."""

    min_version: ClassVar[int] = 3

    tenant: str = ""
    name: str = ""
    task: TaskSpec = TaskSpec(id=0, type="", tenant="")
    first_ms: int = 0
    interval_ms: int | None = None
    cron: str | None = None
    missed: str = "skip"
    grace_ms: int = 60_000


class DeleteSchedule(_Entry, frozen=True, tag="schedule_delete"):
    min_version: ClassVar[int] = 3

    tenant: str = ""
    name: str = ""


class FireSchedule(_Entry, frozen=True, tag="schedule_fire"):
    """The leader handles a schedule's tick ``tick_ms`` (its next_ms, so a tick is handled
    once): creates the task ``task_id`` (None: none) for the tick ``run_tick_ms`` (None:
    tick_ms) and moves the schedule on to ``next_ms``, ``skipped`` ticks dropped."""

    min_version: ClassVar[int] = 3

    tenant: str = ""
    name: str = ""
    tick_ms: int = 0
    next_ms: int = 0
    task_id: int | None = None
    run_tick_ms: int | None = None
    skipped: int = 0


class PauseSchedule(_Entry, frozen=True, tag="schedule_pause"):
    """Pause (``paused``) or resume a schedule: a paused one fires nothing; the ticks that
    pass meanwhile are missed ticks, handled by its ``missed`` policy once resumed
    (docs/DESIGN.md §6, "Periodic tasks"). Already so: a no-op. Written as format 4."""

    min_version: ClassVar[int] = 4

    tenant: str = ""
    name: str = ""
    paused: bool = True


class SetWebhook(_Entry, frozen=True, tag="webhook_set"):
    """A tenant's webhook (``url`` None: none); events after ``after`` are delivered."""

    min_version: ClassVar[int] = 3

    tenant: str = ""
    url: str | None = None
    secret: str = ""
    after: tuple[int, int, int] = (-1, -1, 0)


class WebhookMark(msgspec.Struct, frozen=True, array_like=True):
    tenant: str
    delivered: tuple[int, int, int]


class WebhookProgress(_Entry, frozen=True, tag="webhook_progress"):
    """The leader delivered the webhooks' events up to these keys (one entry per batch)."""

    min_version: ClassVar[int] = 3

    marks: tuple[WebhookMark, ...] = ()


Entry = (
    SubmitTasks
    | CancelTask
    | BeginTransaction
    | CommitTransaction
    | RollbackTransaction
    | SetTenant
    | SetConfig
    | Tick
    | RegisterWorker
    | WorkerDead
    | AssignTasks
    | FinishTasks
    | AddCode
    | CodeReady
    | CreateToken
    | RevokeToken
    | DeleteCode
    | CreateSchedule
    | DeleteSchedule
    | FireSchedule
    | CancelTasks
    | SetWebhook
    | WebhookProgress
    | WorkerSilent
    | PauseSchedule
    | WorkerDisconnected
)


class Confirm(_Entry, frozen=True, tag="lac"):
    """A log-level marker, not a state change: the leader writes one when the log goes
    idle so that the last-add-confirmed it carries lets followers apply the entries
    before it (docs/DESIGN.md §3). Never handed to the state machine."""


Record = Entry | Confirm
"""Everything a ledger entry can hold."""

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Entry)
_record_decoder: Final = msgspec.msgpack.Decoder(Record)


def encode_entry(entry: Entry | Confirm) -> bytes:
    if entry.v < entry.min_version:
        entry = msgspec.structs.replace(entry, v=entry.min_version)
    return _encoder.encode(entry)


def decode_entry(data: bytes) -> Entry:
    entry: Entry = _decode(_decoder, data)
    return entry


def decode_record(data: bytes) -> Record:
    """Decode a ledger entry that may also be a :class:`Confirm` marker."""
    record: Record = _decode(_record_decoder, data)
    return record


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes) -> Any:
    try:
        record = decoder.decode(data)
    except msgspec.DecodeError as exc:
        version = _probe_version(data)
        if version is not None and version > ENTRY_FORMAT_VERSION:
            raise NewerEntryFormatError(version) from exc
        raise EntryDecodeError(f"undecodable log entry: {exc}") from exc
    if record.v > ENTRY_FORMAT_VERSION:
        raise NewerEntryFormatError(record.v)
    return record


def _probe_version(data: bytes) -> int | None:
    try:
        return msgspec.msgpack.decode(data, type=_VersionProbe).v
    except msgspec.DecodeError:
        return None
