"""The state machine's task dependencies: ``after`` on submit, and joins (a spawned child
anchored to several tasks of its tree waits for all of them) (docs/DESIGN.md §2,
"Dependencies").

A task with unfinished dependencies is ``waiting`` but in no run queue: it is indexed only
under each dependency it waits for (``MachineBase.dependants``), so the scheduler's cost
does not grow with the number of blocked tasks, and a dependency's finish releases its
dependants without a scan.
"""

from __future__ import annotations

from collections.abc import Callable

from broker.core.machine_base import MachineBase
from broker.core.records import LIVE_STATES, ErrorCode, Rejected, Task
from broker.core.transitions import TaskState


class DependenciesMixin(MachineBase):
    """Checks a new task's dependencies, blocks it and releases or fails it."""

    def __init__(self) -> None:
        super().__init__()
        # Dependencies that ended while their dependants were being handled (a failure
        # cascades along chains): handled in a loop, not by recursion. Not state.
        self._ended_dependencies: list[int] = []
        self._releasing = False

    def _dependency_check(
        self, tenant: str, after: tuple[int, ...], *, join: bool
    ) -> list[int] | Rejected:
        """The dependencies still to wait for, or why the task may not be created.

        ``after`` (submitted): tasks of the same tenant, existing, not in an uncommitted
        transaction, not ended in error or cancelled. ``join``: the other anchors of a
        spawned child, already checked to be in its tree (of any tenant).
        """
        # Its length and duplicates: validate_task_spec.
        waiting: list[int] = []
        for task_id in after:
            dependency = self.tasks.get(task_id)
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

    def _dependency_ended(self, task: Task) -> None:
        self._ended_dependencies.append(task.id)
        if self._releasing:
            return  # the loop below, further up the stack, handles it
        self._releasing = True
        try:
            while self._ended_dependencies:
                self._release_dependants(self.tasks[self._ended_dependencies.pop(0)])
        finally:
            self._releasing = False

    def _release_dependants(self, dependency: Task) -> None:
        dependants = self.dependants.pop(dependency.id, None)
        if not dependants:
            return
        finished = dependency.state == TaskState.FINISHED
        how = "was cancelled" if dependency.state == TaskState.CANCELLED else "failed"
        for task_id in dependants:  # in the order they started to wait: deterministic
            task = self.tasks[task_id]
            if finished:
                task.waiting_for.remove(dependency.id)
                if not task.waiting_for and task.state == TaskState.WAITING:
                    self._enqueue(task)
                continue
            if task.root is not None and task.root == dependency.root:
                # A join in the same tree: the dependency's end fails the tree, which
                # cancels this task with the tree's reason.
                continue
            if task.state not in LIVE_STATES:
                continue
            task.error = f"dependency {dependency.id} {how}"
            self._move(task, TaskState.ERROR)  # which unlinks it from its other dependencies
            self._dependant_failed(task)

    def _dependant_failed(self, task: Task) -> None:
        """A tree task failed with its dependency: overridden where trees are handled."""

    def _check_dependency_invariants(self, fail: Callable[[str], None]) -> int:
        """Compare ``dependants`` with the live tasks' ``waiting_for``; return how many
        waiting tasks are blocked (in no queue)."""
        expected: dict[int, set[int]] = {}
        blocked = 0
        for task in self.tasks.values():
            if not task.waiting_for:
                continue
            if task.state not in LIVE_STATES:
                fail(f"task {task.id} is {task.state} but still waits for dependencies")
            if task.state == TaskState.WAITING:
                blocked += 1
            for dependency in task.waiting_for:
                other = self.tasks.get(dependency)
                if other is None or other.state not in LIVE_STATES:
                    fail(f"task {task.id} waits for {dependency}, which is not live")
                expected.setdefault(dependency, set()).add(task.id)
        actual = {k: set(v) for k, v in self.dependants.items()}
        if expected != actual:
            fail("dependants index differs from the tasks' waiting_for")
        return blocked
