"""The state machine's task dependencies: ``after`` on submit, and joins (a spawned child
anchored to several tasks of its tree waits for all of them) (docs/DESIGN.md §2,
"Dependencies").

A task with unfinished dependencies is ``waiting`` but in no run queue: it is indexed only
under each dependency it waits for (``DependantsIndex``, broker/core/indexes.py), so the
scheduler's cost does not grow with the number of blocked tasks, and a dependency's finish
releases its dependants without a scan (``Books``, broker/core/books.py, does that).
"""

from __future__ import annotations

from collections.abc import Callable

from broker.core.books import Books
from broker.core.records import LIVE_STATES, ErrorCode, Rejected
from broker.core.transitions import TaskState


def dependency_check(
    books: Books, tenant: str, after: tuple[int, ...], *, join: bool
) -> list[int] | Rejected:
    """The dependencies still to wait for, or why the task may not be created.

    ``after`` (submitted): tasks of the same tenant, existing, not in an uncommitted
    transaction, not ended in error or cancelled. ``join``: the other anchors of a
    spawned child, already checked to be in its tree (of any tenant).
    """
    # Its length and duplicates: validate_task_spec.
    waiting: list[int] = []
    for task_id in after:
        dependency = books.tasks.get(task_id)
        if dependency is None or (not join and dependency.tenant != tenant):
            # Another tenant's task is "not found" too: its existence is not revealed.
            return Rejected(ErrorCode.NOT_FOUND, f"task {task_id} in after does not exist")
        if dependency.state == TaskState.PENDING:
            return Rejected(
                ErrorCode.INVALID,
                f"task {task_id} in after is in an uncommitted transaction",
            )
        if dependency.state in (TaskState.ERROR, TaskState.CANCELLED):
            how = "was cancelled" if dependency.state == TaskState.CANCELLED else "failed"
            return Rejected(ErrorCode.CONFLICT, f"task {task_id} in after {how}")
        if dependency.state != TaskState.FINISHED:
            waiting.append(task_id)
    return waiting


def check_dependency_invariants(books: Books, fail: Callable[[str], None]) -> int:
    """Check the tasks' ``waiting_for`` (the dependants index is checked by itself:
    broker/core/indexes.py); return how many waiting tasks are blocked (in no queue)."""
    blocked = 0
    for task in books.tasks.values():
        if not task.waiting_for:
            continue
        if task.state not in LIVE_STATES:
            fail(f"task {task.id} is {task.state} but still waits for dependencies")
        if task.state == TaskState.WAITING:
            blocked += 1
        for dependency in task.waiting_for:
            other = books.tasks.get(dependency)
            if other is None or other.state not in LIVE_STATES:
                fail(f"task {task.id} waits for {dependency}, which is not live")
    return blocked
