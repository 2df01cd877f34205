"""HTTP API request and response bodies (JSON), shared by the server, the OpenAPI
document and the Python client."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, UnsetType

# The one task-state enum of the API (a named schema, TaskState, in the OpenAPI document).
from broker.core.entries import DEFAULT_MAX_LOST
from broker.core.transitions import TaskState as TaskState

# Integers that travel in log entries must fit msgpack (and most clients' JSON): int64.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# For the schema; the API checks keys again (Python's `$` lets a final newline through).
IdempotencyKey = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\x20-\x7e]+$")
]
# A tenant (or other) name, as broker.core.validation.NAME_RE checks it: for the schema.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
NonNegativeInt64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
MAX_TRANSACTION_TTL_S = 24 * 3600.0
MAX_RETENTION_S = 10 * 365 * 86400.0
RetentionS = Annotated[float, msgspec.Meta(ge=1, le=MAX_RETENTION_S)]
# A time the server writes: RFC 3339 in UTC with milliseconds (common.iso_ms). Sent as the
# string it is (no datetime round trip on the hot path); the schema says what it holds.
DateTime = Annotated[str, msgspec.Meta(extra_json_schema={"format": "date-time"})]


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    # With code "not_leader" (HTTP 307): the leader's base URL, when one is known.
    leader_url: str | None = None
    # True when the same request may succeed if sent again later (or to the leader).
    retryable: bool = False


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class _SharedTaskOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The optional fields of a task that a batch may also set once for all its tasks
    (docs/API.md, "Batches"). ``deadline`` / ``start_after``: RFC 3339 time with a zone,
    or Unix seconds."""

    # Default: the caller's tenant for a tenant token, else "default".
    tenant: str | UnsetType = UNSET
    max_attempts: int = 1
    deadline: datetime | float | None = None
    start_after: datetime | float | None = None
    resources: dict[str, float] = {}
    transaction: Int64 | None = None
    code: str | None = None
    # Track the tree of tasks this one spawns (Storm's guaranteed processing): its
    # status shows in the task's ``tree``; it fails unless complete tree_timeout_s
    # (default 30) after each (re)start of the root, and the root is replayed while
    # attempts remain.
    track_tree: bool = False
    tree_timeout_s: float | None = None
    # Ids of tasks of the same tenant this one runs after: it waits until every one
    # finished, and fails when one fails or is cancelled (docs/API.md, "Dependencies").
    after: Annotated[list[Int64], msgspec.Meta(max_length=100)] = []
    # Higher first among the tenant's waiting tasks (FIFO within a priority); fairness
    # between tenants does not look at it.
    priority: int = 0
    # A failed attempt with attempts left waits (``delayed``) before retry n for
    # retry_backoff_s * 2^(n-1) seconds, capped by retry_backoff_max_s (default 3600),
    # +-25% jitter. 0: retried at once.
    retry_backoff_s: float = 0
    retry_backoff_max_s: float | None = None
    # Accept a type no worker is known to run (a plain name no worker serving the tenant
    # registered yet, or a ``module:function`` without code) and queue it until one does,
    # instead of a 400 (docs/API.md, "Task types").
    allow_unknown_type: bool = False
    # Attempts it may lose with its worker (the worker died, or came back without it)
    # before it fails; they do not count against max_attempts (0 to 100, default 3).
    max_lost: int = DEFAULT_MAX_LOST


class _TaskOptions(_SharedTaskOptions, kw_only=True):
    """A task's optional fields: the shared ones and those naming one task only."""

    params: msgspec.Raw | UnsetType = UNSET  # any JSON value (default null)
    slot: str | None = None


#: The fields of one task that a batch may set for all its tasks (SubmitBody, "tasks").
SHARED_TASK_FIELDS: Final = tuple(f.name for f in msgspec.structs.fields(_SharedTaskOptions))


class TaskSubmission(_TaskOptions, kw_only=True):
    """One task."""

    type: str


class SubmitBody(_TaskOptions, kw_only=True):
    """Either ``{"tasks": [TaskSubmission, ...]}`` or one TaskSubmission's fields. With
    ``tasks``, a shared field (SHARED_TASK_FIELDS) given here applies to every task that
    does not set it; ``params``, ``slot`` and ``type`` name one task and are refused here.

    ``idempotency_key`` (or the ``Idempotency-Key`` header; 1-128 printable ASCII
    characters): a retry with the same key creates nothing and gets the first
    submission's answer again (``replayed: true``). Keys are kept at least 24 h.
    """

    tasks: list[TaskSubmission] | None = None
    type: str | None = None
    idempotency_key: IdempotencyKey | None = None


class SubmitOneBody(TaskSubmission, kw_only=True):
    """POST /api/v1/tasks with one task: its fields (``type`` required). For the OpenAPI
    document only; the server decodes SubmitBody, which takes either form."""

    idempotency_key: IdempotencyKey | None = None


class SubmitBatchBody(_SharedTaskOptions, kw_only=True):
    """POST /api/v1/tasks with a batch: ``tasks`` (each answered in SubmitBatchResponse,
    in order). A field given next to ``tasks`` applies to every task that does not set
    it; a task naming another ``tenant`` than the batch's is refused (400). For the
    OpenAPI document only, like SubmitOneBody."""

    tasks: Annotated[list[TaskSubmission], msgspec.Meta(min_length=1)]
    idempotency_key: IdempotencyKey | None = None


class BulkCancelBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /api/v1/tasks/cancel: the live tasks matching every given filter (at least
    one) are cancelled. ``tenant``: a tenant token's own (the default); an admin's
    choice, none: every tenant's. ``state``: a live state (default: all of them);
    ``tree``: a tracked root's id; ``submitted_before``: RFC 3339 or Unix seconds."""

    tenant: str | None = None
    type: str | None = None
    state: TaskState | None = None
    tree: Int64 | None = None
    submitted_before: datetime | float | None = None
    reason: str | None = None


class BulkCancelResult(msgspec.Struct):
    """``matched``: live tasks matching when the request was read; ``cancelled`` of them
    by this request, ``skipped`` ones that ended meanwhile; ``batches``: log entries."""

    matched: int
    cancelled: int
    skipped: int
    batches: int


class SubmittedTask(msgspec.Struct, omit_defaults=True):
    """A batch member's outcome: ``id`` and ``state`` when accepted, else ``error``."""

    id: int | None = None
    state: TaskState | None = None
    error: ErrorDetail | None = None


class SubmitBatchResponse(msgspec.Struct, omit_defaults=True):
    tasks: list[SubmittedTask]
    replayed: bool = False  # True: the answer of an earlier submission with this key


class TaskRefBody(msgspec.Struct, omit_defaults=True):
    id: int
    state: TaskState
    replayed: bool = False  # True: the answer of an earlier submission with this key


class TreeView(msgspec.Struct, omit_defaults=True):
    """A tracked root's tree: ``pending`` until every task of the current run finished
    (``completed``) or it failed (``failed``, for good: replays show as pending with a
    higher attempt and the last failure's reason)."""

    state: str
    attempt: int
    timeout_s: float
    reason: str | None = None


class TaskProgress(msgspec.Struct):
    """A running task's latest ``ctx.progress(fraction, message)``, as the leader holds it
    (in memory: lost on a failover until the task reports again)."""

    fraction: float  # 0 to 1
    message: str
    attempt: int  # the attempt that reported it
    updated_at: DateTime  # when the leader took the report


class TaskView(msgspec.Struct):
    id: int
    type: str
    tenant: str
    state: TaskState
    params: msgspec.Raw
    attempt: int
    max_attempts: int
    created_at: DateTime
    updated_at: DateTime
    slot: str | None = None
    transaction: int | None = None
    code: str | None = None
    resources: dict[str, float] = {}
    worker: str | None = None
    result: msgspec.Raw | None = None
    error: str | None = None
    deadline: DateTime | None = None
    start_after: DateTime | None = None
    finished_at: DateTime | None = None
    # When the current (or last) attempt started running, and the milliseconds it had
    # been waiting before (since its submission, commit, start_after or a retry's due
    # time; the wait for dependencies counts): queue time and run time told apart.
    started_at: DateTime | None = None
    queued_ms: int | None = None
    tree: TreeView | None = None  # only for a tracked root
    root: int | None = None  # the tracked root whose tree this task belongs to
    parent: int | None = None  # the task whose finish spawned this one
    # Its latest progress report (GET /api/v1/tasks/{id} on the leader only; else null).
    progress: TaskProgress | None = None
    # Dependencies: the tasks it runs after (spawned: the other anchors of its join),
    # and those of them it still waits for (a waiting task stays queued until none).
    after: list[int] = []
    waiting_for: list[int] = []
    priority: int = 0
    # Set when the task retries with a backoff (then a retry's due time is start_after).
    retry_backoff_s: float | None = None
    retry_backoff_max_s: float | None = None
    # Attempts lost with their worker (not counted against max_attempts), and how many it
    # may lose before it fails.
    lost: int = 0
    max_lost: int = DEFAULT_MAX_LOST
    # A running task's worker's state: "connected", or "disconnected" (its connection
    # closed: the task is presumed lost until the worker registers again or the heartbeat
    # timeout declares it dead, docs/DESIGN.md §8, "Closed connections"); null otherwise.
    worker_state: str | None = None
    lost_suspected_at: DateTime | None = None  # when its worker disconnected (else null)


class TaskList(msgspec.Struct):
    tasks: list[TaskView]
    next_after: int | None


class TransactionBegin(msgspec.Struct, forbid_unknown_fields=True):
    # Default: the caller's tenant for a tenant token, else "default".
    tenant: Name | UnsetType = UNSET
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TRANSACTION_TTL_S)] = 60.0


class TransactionView(msgspec.Struct):
    id: int
    tenant: str
    expires_at: DateTime


class TransactionOutcome(msgspec.Struct):
    id: int
    outcome: str
    tasks: list[int]


class TenantLimits(msgspec.Struct, forbid_unknown_fields=True):
    """Service level; fields left out keep their value. 0 means unlimited."""

    max_waiting: NonNegativeInt64 | None = None
    max_running: NonNegativeInt64 | None = None
    weight: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # Tasks/s the leader accepts from the tenant (0: unlimited), with a burst of
    # submit_burst tasks (0: one second's worth); over it: 429 with Retry-After.
    submit_rate: Annotated[float, msgspec.Meta(ge=0)] | None = None
    submit_burst: NonNegativeInt64 | None = None


class TenantView(msgspec.Struct):
    name: str
    max_waiting: int
    max_running: int
    weight: float
    counts: dict[str, int]
    submit_rate: float = 0.0
    submit_burst: int = 0


class WebhookBody(msgspec.Struct, forbid_unknown_fields=True):
    """A tenant's webhook: completion events are POSTed to url, signed with secret."""

    url: str
    secret: str


class WebhookFailing(msgspec.Struct):
    """The event the leader keeps failing to deliver (docs/API.md, Webhooks)."""

    event: str  # its event id: deliveries after it wait for it
    failures: int  # failed tries of it so far
    last_error: str  # "HTTP 503", or the connection error
    last_failed_at: DateTime
    next_retry_at: DateTime


class WebhookView(msgspec.Struct):
    """A tenant's webhook (never its secret); delivered: the id of the last event the
    receiver acknowledged that the log has recorded (the next delivery comes after it)."""

    tenant: str
    url: str
    delivered: str
    pending: int = 0  # events in its outbox after `delivered` (replicated: any broker)
    # Set while the leader's deliveries fail (the leader's own knowledge: null on a
    # follower, and until the first failed try on a new leader).
    failing: WebhookFailing | None = None


class ArtifactView(msgspec.Struct):
    sha256: str
    name: str
    size_bytes: int
    created_at: DateTime
    # False until min_code_replicas brokers hold it (or max_replication_wait passed):
    # tasks using it wait meanwhile.
    ready: bool = True


class TenantList(msgspec.Struct):
    tenants: list[TenantView]


class ArtifactList(msgspec.Struct):
    artifacts: list[ArtifactView]


class Position(msgspec.Struct):
    ledger_id: int
    entry_id: int


class BrokerSummary(msgspec.Struct):
    """One broker as the broker answering sees it (docs/API.md). Every field is always
    sent, nulls included: a null says "unknown", and ``unknown_reason`` says why. The
    fields after ``position`` have defaults so that a client reading an older broker
    (a worker looking for its leader) still decodes it."""

    id: str
    host: str
    port: int
    uptime_secs: float | None
    is_leader: bool
    version: str
    position: Position | None  # its applied log position
    lag_entries: int | None = None  # entries the leader applied and it not yet (leader: 0)
    reachable: bool = True  # it answered the broker asking at its last poll
    last_seen_secs_ago: float | None = None  # since its last answer (the one asked: 0.0)
    started_at: str | None = None  # when it started (by the clock of the broker asked)
    member: bool = True  # advertised in ZooKeeper now; false: left, kept a while
    unknown_reason: str | None = None
    # "leader", "follower", "candidate" (taking over), "standalone", "idle" or "unreachable".
    role: str = "standalone"
    url: str | None = None
    worker_address: str | None = None  # "host:port" of its worker endpoint
    worker_tls: bool = False  # workers connect to worker_address with TLS
    digest: str | None = None  # only for the broker answering


class WorkerSummary(msgspec.Struct):
    id: str
    state: str
    address: str
    running_tasks: int
    resources: dict[str, float]
    # What it serves, as WorkerView: what `steward submit --wait` tells a waiting task by.
    task_types: dict[str, int] = {}  # concurrency per task type ("*": any type)
    tenants: list[str] = []  # tenants served (empty: all)


class ClusterSummary(msgspec.Struct):
    cluster_id: str
    leader: str | None
    brokers: list[BrokerSummary]
    workers: list[WorkerSummary]
    tasks: dict[str, int]
    tenants: int
    # Where to send writes and where workers connect (None while no leader is known).
    leader_url: str | None = None
    leader_worker_address: str | None = None
    leader_worker_tls: bool = False  # connect to leader_worker_address with TLS


class DigestBody(msgspec.Struct):
    position: Position
    digest: str


class ClusterConfigPatch(msgspec.Struct, forbid_unknown_fields=True):
    """Replicated settings; fields left out keep their value."""

    # Replaces the whole map: resource name -> amount (>= 0).
    global_limits: dict[Name, Annotated[float, msgspec.Meta(ge=0)]] | None = None
    finished_task_retention_s: Annotated[float, msgspec.Meta(ge=1, le=MAX_RETENTION_S)] | None = (
        None
    )


class ClusterConfigView(msgspec.Struct):
    global_limits: dict[str, float]
    finished_task_retention_s: float


class Health(msgspec.Struct):
    status: str
    writable: bool
    position: Position
    reason: str | None = None
    role: str = "standalone"
    uptime_secs: float | None = None  # for peers' cluster views (docs/DESIGN.md §4)
    version: str | None = None
    # The leader's last entry followers can apply (less a trailing Confirm marker): what
    # lags are counted against. Null on the others.
    catch_up_position: Position | None = None


# --- dashboard (read-only views for the web page at /) ---------------------------------


class BrokerStatus(msgspec.Struct):
    """One broker as the cluster view of the broker answering has it (the rows of
    ``GET /api/v1/cluster``), for the dashboard."""

    id: str
    url: str | None
    # "leader", "follower", "candidate", "standalone", "idle" or "unreachable".
    role: str
    is_leader: bool
    reachable: bool
    writable: bool | None = None  # only for the broker answering
    position: Position | None = None
    # Entries behind the leader's last entry followers can apply (0: in sync); None when
    # unknown (no leader, unreachable, or still in an older ledger: see behind_ledgers).
    lag_entries: int | None = None
    behind_ledgers: bool = False
    uptime_secs: float | None = None
    error: str | None = None  # why something is unknown (unreachable: since when)
    last_seen_secs_ago: float | None = None  # since its last answer (the one asked: 0.0)
    member: bool = True  # advertised in ZooKeeper now; false: left, kept a while


class BrokerStatusList(msgspec.Struct):
    cluster_id: str
    answered_by: str
    leader: str | None
    brokers: list[BrokerStatus]


class WorkerView(msgspec.Struct):
    """A worker with its capacities and the tasks running on it."""

    id: str
    state: str  # "connected", "disconnected" (not yet back or declared dead) or "dead"
    address: str
    task_types: dict[str, int]  # concurrency per task type ("*": any type)
    resources: dict[str, float]  # resources offered
    tenants: list[str]  # tenants served (empty: all)
    running_tasks: int
    running: list[int]  # the lowest ids of the running tasks, at most 50
    connected_at: DateTime
    updated_at: DateTime
    reason: str | None = None  # why it is dead


class WorkerList(msgspec.Struct):
    workers: list[WorkerView]


class ThroughputView(msgspec.Struct):
    """Tasks per bucket over the last minutes, oldest bucket first; the last bucket is
    the current (partial) one. Counted by the answering broker from the entries it
    applied (leader-stamped times), so every caught-up broker shows the same counts."""

    bucket_s: float
    end_ms: int  # end of the newest bucket, epoch ms
    submitted: list[int]
    finished: list[int]
    failed: list[int]
    cancelled: list[int]
    max_task_id: int  # the highest task id assigned so far


class RecentTaskList(msgspec.Struct):
    """Matching tasks, newest (highest id) first; page on with ``before=next_before``."""

    tasks: list[TaskView]
    next_before: int | None


def schema_components(types: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    refs, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    return list(refs), dict(components)


class TokenCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An API token to issue: ``role`` "tenant" (with ``tenant``), "admin", or "worker"
    (a worker credential, optionally limited to ``tenants``)."""

    name: str
    role: str = "tenant"
    tenant: str | None = None
    # A worker credential's tenants: its workers may serve these only (none: every tenant).
    tenants: list[str] | None = None


class TokenView(msgspec.Struct, kw_only=True):
    id: str
    name: str
    role: str
    tenant: str | None
    created_at: DateTime
    tenants: list[str] = []  # a worker credential's tenants (empty: every tenant)


class TokenCreated(TokenView, kw_only=True):
    """The new token's secret is in this answer only (the brokers keep its hash)."""

    token: str


class TokenList(msgspec.Struct):
    tokens: list[TokenView]


class WhoAmI(msgspec.Struct, kw_only=True):
    role: str
    tenant: str | None
    token_id: str | None
    auth: bool  # whether this broker requires tokens


class ScheduledTask(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The task a schedule creates at each tick (its tenant is the schedule's)."""

    type: str
    params: msgspec.Raw | UnsetType = UNSET  # any JSON value (default null)
    max_attempts: int = 1
    resources: dict[str, float] = {}
    code: str | None = None
    max_lost: int = DEFAULT_MAX_LOST  # as a task's


class ScheduleCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /api/v1/schedules: ``cron`` (5 fields, or 6 with seconds; UTC) or
    ``interval_s``; ``missed``: what happens to ticks no leader fired in time."""

    name: Name
    tenant: str | UnsetType = UNSET  # as a task's
    task: ScheduledTask
    cron: str | None = None
    interval_s: float | None = None
    missed: str = "skip"  # "skip" | "run_once" | "run_all"
    # A skip schedule's tick fired later than this (1 s to 366 days) is skipped.
    grace_s: float = 60.0


class ScheduleFiring(msgspec.Struct):
    tick: DateTime
    task_id: int | None  # null: the tick created no task (its submit was refused)


class ScheduleView(msgspec.Struct, omit_defaults=True):
    name: str
    tenant: str
    task: ScheduledTask
    missed: str
    grace_s: float
    next_tick: DateTime  # the next tick not yet handled
    created: DateTime
    runs: int  # tasks created
    skipped: int  # ticks that created no task
    recent: list[ScheduleFiring]  # the last firings that ran a tick, oldest first
    paused: bool  # fires nothing until resumed (docs/API.md, "Periodic tasks")
    paused_at: DateTime | None  # when it was paused (null: not paused)
    cron: str | None = None
    interval_s: float | None = None
    last_error: str | None = None


class ScheduleList(msgspec.Struct):
    schedules: list[ScheduleView]


# The states a tree view shows: a tree record's, with ``timed_out`` told apart from
# ``failed`` (failed for good because its last run timed out). Not an enum in the schema:
# "pending" would repeat a TaskState value (one task-state enum, tests/unit/test_openapi.py).
TreeViewState = Annotated[str, msgspec.Meta(description="pending, completed, failed or timed_out")]


class TreeDetail(msgspec.Struct):
    """A tracked tree as GET /api/v1/trees/{root} shows it (Storm's acker entry, visible)."""

    root: int
    tenant: str
    state: TreeViewState
    attempt: int  # run of the tree: 1, + 1 at each replay of the root
    timeout_s: float
    started_at: DateTime  # when its root was submitted
    # Seconds from started_at until it ended (or until now while pending).
    age_s: float
    # Its tasks (of every run still kept) by state: every TaskState, 0 included.
    tasks: dict[str, int]
    # Live tasks the tree waits for (their acks), lowest ids first, at most 100 listed;
    # pending_count counts them all.
    pending_anchors: list[int]
    pending_count: int
    deadline: DateTime | None = None  # when the current run times out (once the root runs)
    ended_at: DateTime | None = None
    reason: str | None = None  # why the (last) run failed


class TreeList(msgspec.Struct):
    trees: list[TreeDetail]
    next_after: int | None  # pass as after for the next page (None: no more)
