"""What an applied entry did, as values: ``StateMachine.apply`` returns an ``Applied``.

``Applied.result`` answers the proposer; ``Applied.effects`` lists, in the order they
happened, the events other parts of the broker react to (docs/DESIGN.md §1): a task
started on a worker (the leader sends it its Assign frame), a task reaching a final
state, a running task the broker ended (its worker must be told), a task tree ending for
good. They are computed the same way on the leader, every follower and
replay; each consumer decides whether to use them. They are not state: snapshots and
``digest()`` never see them.
"""

from __future__ import annotations

import msgspec

from broker.core.records import ApplyResult, StopRunning
from broker.core.transitions import TaskState

# Structs the cyclic garbage collector does not track (gc=False: nothing in them can form a
# cycle). One is made per final task; tracked, they made the collector run more often in
# the scheduling hot path (docs/BENCHMARKS.md, issue 15).


class TaskFinal(msgspec.Struct, frozen=True, gc=False):
    """A task reached a final state (finished, error or cancelled)."""

    task_id: int
    state: TaskState


class TaskAssigned(msgspec.Struct, frozen=True, gc=False):
    """A task started an attempt on a worker (by an AssignTasks entry or the assignments
    a SubmitTasks entry carries): the worker must be sent the task."""

    task_id: int
    worker_id: str
    attempt: int


class TreeEnded(msgspec.Struct, frozen=True, gc=False):
    """A tracked task tree completed or failed for good (no replay left)."""

    root_id: int


class AttemptLost(msgspec.Struct, frozen=True, gc=False):
    """A running attempt was lost with its worker (it died, or came back without it): not
    counted against max_attempts (docs/DESIGN.md §6, "Lost workers"); the task waits
    again, or failed past its max_lost."""

    task_id: int
    worker_id: str
    attempt: int


# StopRunning (a running task was ended by the broker: tell its worker) lives in
# broker.core.records, where it always was; it is one of the effects.
Effect = TaskFinal | StopRunning | TreeEnded | TaskAssigned | AttemptLost


class Applied(msgspec.Struct, frozen=True, gc=False):
    """The outcome of one ``StateMachine.apply``: its result and its effects."""

    result: ApplyResult
    effects: tuple[Effect, ...] = ()

    @property
    def final_ids(self) -> list[int]:
        """Ids of the tasks that became final, in order."""
        return [effect.task_id for effect in self.effects if type(effect) is TaskFinal]

    @property
    def assigned(self) -> list[TaskAssigned]:
        """The attempts started on workers, in order."""
        return [effect for effect in self.effects if type(effect) is TaskAssigned]

    @property
    def stops(self) -> list[StopRunning]:
        """The running tasks the broker ended, in order."""
        return [effect for effect in self.effects if type(effect) is StopRunning]

    @property
    def lost(self) -> list[AttemptLost]:
        """The attempts lost with their worker, in order."""
        return [effect for effect in self.effects if type(effect) is AttemptLost]

    @property
    def trees_ended(self) -> list[int]:
        """Roots of the trees that ended for good, in order."""
        return [effect.root_id for effect in self.effects if type(effect) is TreeEnded]
