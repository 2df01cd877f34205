"""The pure replicated state machine: log entries, apply, the scheduler (no IO, no asyncio).

The names other packages use are exported here (``from broker.core import StateMachine,
Task``); each is defined in one module of the package (docs/DESIGN.md §2, "The state
machine's parts"). They load on first use (PEP 562): a process that imports only
``broker.core.entries`` (a worker does) does not load the state machine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.core.effects import Applied as Applied
    from broker.core.effects import Effect as Effect
    from broker.core.effects import TaskAssigned as TaskAssigned
    from broker.core.effects import TaskFinal as TaskFinal
    from broker.core.effects import TreeEnded as TreeEnded
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
    from broker.core.records import Schedule as Schedule
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
    from broker.core.state import StateMachine as StateMachine
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

# Each exported name -> the module that defines it (tests/unit/test_core_parts.py holds
# this table and the imports above equal).
_HOMES: dict[str, str] = {
    "StateMachine": "broker.core.state",
    "Applied": "broker.core.effects",
    "Effect": "broker.core.effects",
    "TaskAssigned": "broker.core.effects",
    "TaskFinal": "broker.core.effects",
    "TreeEnded": "broker.core.effects",
    "FINAL_STATES": "broker.core.records",
    "LIVE_STATES": "broker.core.records",
    "QUEUED_STATES": "broker.core.records",
    "TASK_HOLDING_WORKER_STATES": "broker.core.records",
    "ApiToken": "broker.core.records",
    "ApplyResult": "broker.core.records",
    "Artifact": "broker.core.records",
    "ArtifactUpload": "broker.core.records",
    "CancelCount": "broker.core.records",
    "Config": "broker.core.records",
    "ErrorCode": "broker.core.records",
    "InvariantError": "broker.core.records",
    "Rejected": "broker.core.records",
    "RememberedResult": "broker.core.records",
    "ReplayedResults": "broker.core.records",
    "Schedule": "broker.core.records",
    "StopRunning": "broker.core.records",
    "SubmissionRecord": "broker.core.records",
    "Task": "broker.core.records",
    "TaskRef": "broker.core.records",
    "Tenant": "broker.core.records",
    "Transaction": "broker.core.records",
    "TransactionDone": "broker.core.records",
    "TransactionRef": "broker.core.records",
    "TreeRecord": "broker.core.records",
    "TreeState": "broker.core.records",
    "Worker": "broker.core.records",
    "WorkerReconciled": "broker.core.records",
    "WorkerState": "broker.core.records",
    "idempotency_scope": "broker.core.records",
    "tree_value": "broker.core.records",
    "SNAPSHOT_BODY_VERSION": "broker.core.snapshot_body",
    "SnapshotBody": "broker.core.snapshot_body",
    "TaskState": "broker.core.transitions",
    "IDEMPOTENCY_KEY_RE": "broker.core.validation",
    "IDEMPOTENCY_MIN_RETENTION_MS": "broker.core.validation",
    "MAX_ATTEMPTS_LIMIT": "broker.core.validation",
    "MAX_RESOURCES": "broker.core.validation",
    "MAX_SLOT_CHARS": "broker.core.validation",
    "MAX_TOKEN_NAME_CHARS": "broker.core.validation",
    "MAX_TOKEN_TENANTS": "broker.core.validation",
    "MAX_TREE_TIMEOUT_MS": "broker.core.validation",
    "NAME_RE": "broker.core.validation",
    "TASK_TYPE_RE": "broker.core.validation",
    "TOKEN_ROLES": "broker.core.validation",
    "validate_idempotency_key": "broker.core.validation",
    "validate_limits": "broker.core.validation",
    "validate_task_spec": "broker.core.validation",
    "validate_token_fields": "broker.core.validation",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
