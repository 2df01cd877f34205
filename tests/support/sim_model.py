"""The state machine simulation's vocabulary (tests/sim/test_simulation.py): tenants, types,
slots and code the generator picks from, the traced primary replica that records every
task transition, and ``Expect``: what the generator knows for sure about a result.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Final

from broker.core import (
    FINAL_STATES,
    LIVE_STATES,
    QUEUED_STATES,
    ErrorCode,
    StateMachine,
    Task,
    TaskState,
)
from broker.core import entries as e

DEFAULT_SEEDS: Final = 20
DEFAULT_ENTRIES: Final = 10_000
#: check_invariants() runs this often (and after SetConfig entries, and at the end).
INVARIANTS_EVERY: Final = 50
#: The independent full scan runs this often, half-way between two check_invariants()
#: (and after entries that hit a timer's due time, and at the end).
SCAN_EVERY: Final = 50
#: Digests of all replicas are compared this often (and at the end).
DIGEST_EVERY: Final = 500

TENANTS: Final = ("t0", "t1", "t2", "t3")
TENANT_WEIGHTS: Final = (4, 3, 2, 1)
BAD_TENANTS: Final = ("", "-t", "bad tenant", "x" * 65, "t/0", ".t")
TYPES: Final = ("py", "spark", "sql.query", "ns:job", "_private")
BAD_TYPES: Final = ("", ".py", "bad type", "x" * 129, "café")
SLOTS: Final = tuple(f"slot-{i}" for i in range(8))
SPAWN_REFUSED_RE: Final = re.compile(r"spawn refused: tenant '([^']+)' max_waiting (\d+) reached")
WORKERS: Final = ("w0", "w1", "w2", "w3", "w4")
BAD_KEYS: Final = ("", "k" * 129, "clé", "tab\tkey", "line\n")
CODE_SHAS: Final = (
    "0123456789abcdef" * 4,
    "ab" * 32,
    "0" * 64,
    # More artifacts so that some arrive not ready (AddCode ready=False) late in a run too.
    *(hashlib.sha256(bytes([i])).hexdigest() for i in range(5)),
)

PENDING: Final = TaskState.PENDING.value
DELAYED: Final = TaskState.DELAYED.value
WAITING: Final = TaskState.WAITING.value
RUNNING: Final = TaskState.RUNNING.value
FINISHED: Final = TaskState.FINISHED.value
ERROR: Final = TaskState.ERROR.value
CANCELLED: Final = TaskState.CANCELLED.value
FINAL: Final = frozenset(s.value for s in FINAL_STATES)
LIVE: Final = frozenset(s.value for s in LIVE_STATES)
QUEUED: Final = frozenset(s.value for s in QUEUED_STATES)


# --- the traced primary replica ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One task state transition; ``None`` as old/new means created/deleted."""

    task_id: int
    old: str | None
    new: str | None
    attempt: int
    task: Task


class TracedMachine(StateMachine):
    """A StateMachine that records every task transition (and changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []

    def add_task(self, task: Task) -> None:
        self.events.append(Event(task.id, None, str(task.state), task.attempt, task))
        super().add_task(task)

    def move(self, task: Task, new: TaskState) -> None:
        # Recorded first: a move may cause others (a dependency's end releases or fails
        # its dependants), which then follow it, as their effects do.
        if str(task.state) != str(new):
            self.events.append(Event(task.id, str(task.state), str(new), task.attempt, task))
        super().move(task, new)

    def delete_task(self, task: Task) -> None:
        self.events.append(Event(task.id, str(task.state), None, task.attempt, task))
        super().delete_task(task)


# --- the generator --------------------------------------------------------------


@dataclass(slots=True)
class Expect:
    """What the generator knows for sure about an entry's result.

    ``reject[i]``: result i (0 for single-result entries) must be a Rejected
    with one of these codes. ``accept``: result indexes that must not be
    rejected.
    """

    reject: dict[int, frozenset[ErrorCode]] = field(default_factory=dict)
    accept: set[int] = field(default_factory=set)
    scan: bool = False  # run the full scan right after this entry


INVALID: Final = frozenset({ErrorCode.INVALID})
STALE: Final = frozenset({ErrorCode.STALE})
NOT_FOUND: Final = frozenset({ErrorCode.NOT_FOUND})
CONFLICT: Final = frozenset({ErrorCode.CONFLICT})
#: The error of an attempt given back because it never reached its worker's process.
LOST: Final = "given back: the assignment never reached this worker process"


def give_back_unreceived(
    view: StateMachine, register: e.RegisterWorker
) -> tuple[e.Entry, Expect] | None:
    """What the leader logs before ``register`` when the very process the state has
    registered comes back without attempts it was assigned (docs/DESIGN.md §6, "Lost
    assignments"): a FinishTasks giving them back, each accepted. None: nothing to give."""
    worker = register.worker_id
    lost = view.unreceived_attempts(worker, register.process_id, None, register.running)
    if not lost:
        return None
    outcomes = tuple(
        e.TaskOutcome(ta.task_id, worker, ta.attempt, ok=False, error=LOST, released=True)
        for ta in lost
    )
    # Not each accepted for sure: a timer due at the entry's time (a tree's timeout) may
    # end one first.
    return e.finish_tasks(register.time_ms, outcomes), Expect()
