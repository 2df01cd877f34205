"""The leader's placements in flight: assignments put into submit entries being logged
(docs/DESIGN.md §6, "Assignment in the submit's own entry").

Where new tasks go is the core's pure rule (broker/core/placement.py, on the fit rule of
broker/core/fit.py); :class:`SubmitPlacement` only keeps the placements it made that are
logged and not yet applied, so the next submit counts their slots. It is the one owner of
that reservation: the proposer that asked for placements gives them back when its entry
is settled (:meth:`SubmitPlacement.release`, applied or never to be), and meanwhile a
placement whose task the state already holds counts as applied (its slot is then in the
state's own counts, or apply refused it and the task waits).

While placements are in flight the scheduler defers its round (the link asks
:attr:`SubmitPlacement.busy`): a round computed before they are applied would not count
their slots, and ``AssignTasks`` does not re-check capacity. They are applied within one
group commit; the applied submit wakes the scheduler, and so does the release of the last
placement of an entry never applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from broker.core import StateMachine
from broker.core import entries as e
from broker.core.placement import Placement, place_new_tasks


class SubmitPlacement:
    """The worker link's :class:`~broker.replication.node.SubmitPlacer`."""

    def __init__(self, state: Callable[[], StateMachine], eligible: Mapping[str, object]) -> None:
        self._state = state
        self._eligible = eligible  # the connected sessions, by worker id
        self._placed: dict[int, Placement] = {}  # by task id: logged, not yet released
        self._by_worker: dict[str, dict[int, Placement]] = {}
        self.deferred = False  # the scheduler skipped a round while busy
        self.paused = False  # the broker is stopping: place nothing (DESIGN §6, "Stopping")
        self.wake: Callable[[], None] = lambda: None

    @property
    def busy(self) -> bool:
        """Whether a placement is logged and not yet applied."""
        tasks = self._state().tasks
        return any(task_id not in tasks for task_id in self._placed)

    def place(self, tasks: Sequence[e.TaskSpec], now_ms: int) -> tuple[e.Assignment, ...]:
        if self.paused or not self._eligible or not tasks:
            return ()
        state = self._state()
        tenant = tasks[0].tenant
        in_flight = sum(
            1 for p in self._placed.values() if p.tenant == tenant and p.task_id not in state.tasks
        )
        placed = place_new_tasks(
            state, tasks, now_ms, self._eligible, lambda w: self._in_flight(state, w), in_flight
        )
        for item in placed:
            self._placed[item.task_id] = item
            self._by_worker.setdefault(item.worker_id, {})[item.task_id] = item
        return tuple(e.Assignment(item.task_id, item.worker_id) for item in placed)

    def release(self, assignments: tuple[e.Assignment, ...]) -> None:
        """The entry carrying these assignments was applied or will never be."""
        for assignment in assignments:
            placed = self._placed.pop(assignment.task_id, None)
            if placed is not None:
                on_worker = self._by_worker.get(placed.worker_id)
                if on_worker is not None:
                    on_worker.pop(assignment.task_id, None)
                    if not on_worker:
                        del self._by_worker[placed.worker_id]
        if self.deferred and not self.busy:
            self.deferred = False
            self.wake()

    def _in_flight(self, state: StateMachine, worker_id: str) -> list[Placement]:
        """The placements on ``worker_id`` not yet applied (an applied one is in the state)."""
        on_worker = self._by_worker.get(worker_id, {})
        return [p for task_id, p in on_worker.items() if task_id not in state.tasks]
