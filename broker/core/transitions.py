"""The task states and the one table of legal task state transitions.

``TRANSITIONS`` maps each state (``None``: the task does not exist yet) to the states it may
move to (``None``: the task is deleted), each edge with why it happens and the entry types
that may cause it. The state machine calls ``check_move`` on every change of state
(``Books.move``, broker/core/books.py), creation of a task (not its restore from a
snapshot) and deletion: it is deterministic, so an illegal move is a bug (an
``AssertionError``), not an input to reject. The simulation test
(tests/sim/test_simulation.py, its checks in tests/support/sim_checks.py) checks every
traced transition, creation and deletion included, against the same table, and the state
diagram in docs/DESIGN.md ("Task states") is checked against it by
tests/unit/test_transitions.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from broker.core import entries as e


class TaskState(StrEnum):
    PENDING = "pending"  # inside an uncommitted transaction
    DELAYED = "delayed"  # waiting for its start_after time
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ERROR = "error"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Edge:
    """Why a transition happens, and in which entries.

    ``entries``: the entry types whose own handler makes the move, or ``ANY_ENTRY`` when a
    timer firing at the start of any entry (deadline, start_after, transaction expiry,
    purge, a tree's timeout) may also cause it.
    """

    reason: str
    entries: frozenset[type[e.Entry]] | None


ANY_ENTRY: Final = None

_PENDING, _DELAYED, _WAITING, _RUNNING = (
    TaskState.PENDING,
    TaskState.DELAYED,
    TaskState.WAITING,
    TaskState.RUNNING,
)
_FINISHED, _ERROR, _CANCELLED = TaskState.FINISHED, TaskState.ERROR, TaskState.CANCELLED

# from-state -> {to-state: Edge}. None as from-state: created; None as to-state: deleted.
TRANSITIONS: Final[Mapping[TaskState | None, Mapping[TaskState | None, Edge]]] = {
    None: {
        _PENDING: Edge("submitted inside a transaction", frozenset({e.SubmitTasks})),
        _DELAYED: Edge(
            "submitted or spawned with a future start_after",
            frozenset({e.SubmitTasks, e.FinishTasks}),
        ),
        _WAITING: Edge("submitted or spawned", frozenset({e.SubmitTasks, e.FinishTasks})),
    },
    _PENDING: {
        _DELAYED: Edge("committed, start_after ahead", frozenset({e.CommitTransaction})),
        _WAITING: Edge("transaction committed", frozenset({e.CommitTransaction})),
        _CANCELLED: Edge("cancelled, or its tree timed out", ANY_ENTRY),
        _ERROR: Edge("deadline exceeded, or a dependency failed", ANY_ENTRY),
        None: Edge("transaction rolled back or expired", ANY_ENTRY),
    },
    _DELAYED: {
        _WAITING: Edge("start_after reached", ANY_ENTRY),
        _CANCELLED: Edge("cancelled, or its tree failed", ANY_ENTRY),
        _ERROR: Edge("deadline exceeded, or a dependency failed", ANY_ENTRY),
    },
    _WAITING: {
        _RUNNING: Edge("assigned to a worker", frozenset({e.AssignTasks, e.SubmitTasks})),
        _CANCELLED: Edge("cancelled, or its tree failed", ANY_ENTRY),
        _ERROR: Edge("deadline exceeded, or a dependency failed", ANY_ENTRY),
    },
    _RUNNING: {
        _FINISHED: Edge("finished ok", frozenset({e.FinishTasks})),
        _WAITING: Edge(
            "an attempt failed with attempts left, was lost with its worker, was given back"
            " by a stopping worker or broker, or a root replayed",
            ANY_ENTRY,
        ),
        _ERROR: Edge(
            "deadline exceeded, its last attempt failed, or lost more than max_lost times",
            ANY_ENTRY,
        ),
        _CANCELLED: Edge("cancelled, or its tree failed", ANY_ENTRY),
        _DELAYED: Edge("an attempt failed with attempts left and a retry backoff", ANY_ENTRY),
    },
    _FINISHED: {
        _WAITING: Edge("a root replayed after its tree failed", ANY_ENTRY),
        None: Edge("purged after the finished-task retention", ANY_ENTRY),
    },
    _ERROR: {None: Edge("purged after the finished-task retention", ANY_ENTRY)},
    _CANCELLED: {None: Edge("purged after the finished-task retention", ANY_ENTRY)},
}

# The same table flattened: (old, new) -> Edge.
EDGES: Final[Mapping[tuple[TaskState | None, TaskState | None], Edge]] = {
    (old, new): edge for old, targets in TRANSITIONS.items() for new, edge in targets.items()
}


# For check_move: from-state -> the set of allowed to-states (TaskState is a StrEnum, so a
# plain state string, as a Task holds it, finds the same key).
_ALLOWED: Final[Mapping[str | None, frozenset[str | None]]] = {
    old: frozenset(targets) for old, targets in TRANSITIONS.items()
}


def check_move(old: str | None, new: str | None) -> None:
    """Raise ``AssertionError`` naming the move unless ``TRANSITIONS`` allows ``old -> new``."""
    allowed = _ALLOWED.get(old)
    if allowed is None or new not in allowed:
        raise AssertionError(f"illegal task state transition {old} -> {new}")
