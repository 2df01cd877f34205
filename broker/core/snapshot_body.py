"""The snapshot body: the whole replicated state as stored in snapshots and hashed by
``StateMachine.digest()``, with its msgpack encoder and decoder.

Pure like the state machine (no IO, no clock); ``broker/core/state.py`` re-exports every
name, so other modules import them from one place.
"""

from __future__ import annotations

from typing import Final

import msgspec

from broker.core.entries import DEFAULT_MAX_LOST
from broker.core.records import (
    ApiToken,
    Artifact,
    Config,
    Schedule,
    SubmissionRecord,
    Task,
    Tenant,
    Transaction,
    TreeRecord,
    Worker,
    WorkerState,
)


class SnapshotBody(msgspec.Struct):
    """The whole replicated state, as stored in snapshots and hashed by digest()."""

    format_version: int
    now_ms: int
    max_task_id: int
    max_transaction_id: int
    config: Config
    tenants: list[Tenant]
    tasks: list[Task]
    transactions: list[Transaction]
    workers: list[Worker]
    artifacts: list[Artifact]
    # Exact FIFO order of each tenant's waiting queue (scheduling depends on it).
    waiting: dict[str, list[int]]
    # Remembered idempotency keys, oldest first (the default reads older snapshots).
    idempotency: list[SubmissionRecord] = []
    # Tracked task trees, in creation order (the default reads older snapshots).
    trees: list[TreeRecord] = []
    # API tokens (hashes only), in creation order (the default reads older snapshots).
    tokens: list[ApiToken] = []
    # Periodic-task schedules, in creation order (the default reads older snapshots).
    schedules: list[Schedule] = []
    # Each webhook's undelivered events, (key, task id) in log order, by tenant (the
    # default reads older snapshots).
    webhook_outbox: dict[str, list[tuple[tuple[int, int, int], int]]] = {}
    # The task type names workers listed, by the tenant they serve ("": every tenant), and
    # the tenants over the cap (broker/core/served_types.py; the defaults read older
    # snapshots: nothing listed).
    served_types: dict[str, list[str]] = {}
    served_types_full: list[str] = []


#: The newest body version this code writes and reads. 2: what a version-1 reader would
#: silently drop (its decoder skips unknown fields) and so fork its state: schedules,
#: webhooks and their outboxes, a tenant's submit rate, a task's dependencies, priority or
#: retry backoff. A body holding none of them is still written as 1 (body_version).
#: 3: a worker's silent_since_ms (docs/DESIGN.md §8, "Silence across leader changes"), a
#:    schedule's paused_ms (§6, "Periodic tasks").
#: 4: a task's lost attempts or a max_lost other than the default, in a task or a
#:    schedule's template (§6, "Lost workers"); a task's started_ms and queued_ms
#:    (docs/API.md, "Task times"); a disconnected worker (§8, "Closed connections"): a
#:    version-3 reader would count its running tasks on a dead worker; the served task types
#:    and the workers that list theirs (docs/DESIGN.md §6, "Served task types").
SNAPSHOT_BODY_VERSION: Final = 4
_snapshot_encoder: Final = msgspec.msgpack.Encoder()
_snapshot_decoder: Final = msgspec.msgpack.Decoder(SnapshotBody)
#: The oldest body version this code reads (docs/OPERATIONS.md, "Rolling upgrade").
OLDEST_SNAPSHOT_BODY_VERSION: Final = 1


def body_version(body: SnapshotBody) -> int:
    """The oldest body version whose readers keep everything ``body`` holds."""
    if any(
        t.lost or t.max_lost != DEFAULT_MAX_LOST or t.started_ms is not None for t in body.tasks
    ) or any(s.task.max_lost != DEFAULT_MAX_LOST for s in body.schedules):
        return 4
    if (
        any(w.state == WorkerState.DISCONNECTED for w in body.workers)
        or body.served_types
        or any(w.lists_task_names for w in body.workers)
    ):
        return 4
    if any(w.silent_since_ms is not None for w in body.workers) or any(
        s.paused_ms is not None for s in body.schedules
    ):
        return 3
    if (
        body.schedules
        or body.webhook_outbox
        or any(t.webhook is not None or t.submit_rate or t.submit_burst for t in body.tenants)
        or any(t.after or t.priority or t.retry_backoff_ms for t in body.tasks)
    ):
        return 2
    return 1


class SnapshotBodyVersionError(ValueError):
    """A snapshot body of a version this code cannot read; ``newer``: written by a newer
    release (upgrade the broker), else one too old for it."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.newer = version > SNAPSHOT_BODY_VERSION
        if self.newer:
            what = f"newer than this broker's {SNAPSHOT_BODY_VERSION}: upgrade the broker"
        else:
            what = f"older than the oldest this broker reads ({OLDEST_SNAPSHOT_BODY_VERSION})"
        super().__init__(f"snapshot body format version {version} is {what}")


def check_snapshot_body_version(version: int) -> None:
    """Raise :class:`SnapshotBodyVersionError` unless this code reads body ``version``."""
    if not OLDEST_SNAPSHOT_BODY_VERSION <= version <= SNAPSHOT_BODY_VERSION:
        raise SnapshotBodyVersionError(version)


class _BodyVersionProbe(msgspec.Struct):
    format_version: int


def decode_snapshot_body(data: bytes) -> SnapshotBody:
    """The body, or :class:`SnapshotBodyVersionError` for a version this code cannot read
    (checked first when the body does not decode: a newer layout is a version problem)."""
    try:
        body = _snapshot_decoder.decode(data)
    except msgspec.DecodeError:
        try:
            version = msgspec.msgpack.decode(data, type=_BodyVersionProbe).format_version
        except msgspec.DecodeError:
            raise  # the original error: not a body at all
        check_snapshot_body_version(version)
        raise
    check_snapshot_body_version(body.format_version)
    return body
