"""The snapshot body: the whole replicated state as stored in snapshots and hashed by
``StateMachine.digest()``, with its msgpack encoder and decoder.

Moved out of ``broker/core/state.py`` (which re-exports every name); pure like it.
"""

from __future__ import annotations

from typing import Final

import msgspec

from broker.core.records import (
    ApiToken,
    Artifact,
    Config,
    SubmissionRecord,
    Task,
    Tenant,
    Transaction,
    TreeRecord,
    Worker,
)
from broker.core.schedules import Schedule


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


SNAPSHOT_BODY_VERSION: Final = 1
_snapshot_encoder: Final = msgspec.msgpack.Encoder()
_snapshot_decoder: Final = msgspec.msgpack.Decoder(SnapshotBody)
