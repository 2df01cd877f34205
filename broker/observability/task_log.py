"""The broker's task log lines: what happened to tasks, one line per event.

Written by the acting leader right after it applies a durable entry (the same place
and for the same reason as the task counters in broker/observability/metrics.py: once per
event, never again for a follower or a replay). Every line carries ``task_id`` and ``tenant``
(broker/observability/logs.py shows them in text and JSON). Levels keep the hot path quiet:
assignments, successful finishes and refused entries are DEBUG (one per task at full rate,
and ``isEnabledFor`` is checked once per entry); retries, given-back and lost attempts, failures,
cancellations and the end of task trees are INFO (a retry delayed by its backoff too, with
its delay).
"""

from __future__ import annotations

import logging
from typing import Final

from broker.core import Applied, Rejected, StateMachine, TaskRef, TaskState
from broker.core import entries as e
from broker.observability.logs import task_fields

logger: Final = logging.getLogger("steward.tasks")

_ERROR_CHARS: Final = 300


def _first_line(text: str | None) -> str:
    line = (text or "").strip().split("\n", 1)[0]
    return line if len(line) <= _ERROR_CHARS else line[:_ERROR_CHARS] + "..."


def _given_back_reason(error: str | None) -> str:
    # Reports of given-back attempts say "given back: <why>"; the line says it already.
    line = _first_line(error)
    return line.removeprefix("given back: ") or "given back"


def log_applied(
    entry: e.Entry,
    applied: Applied,
    state: StateMachine,
) -> None:
    """Log the task events of one applied entry (leader only)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    result = applied.result
    debug = logger.isEnabledFor(logging.DEBUG)
    tasks = state.tasks
    kind = type(entry)
    if kind is e.FinishTasks:
        assert isinstance(entry, e.FinishTasks) and isinstance(result, list)
        for outcome, ref in zip(entry.outcomes, result, strict=False):
            task = tasks.get(outcome.task_id)
            if task is None:
                continue
            fields = task_fields(task.id, task.tenant, attempt=outcome.attempt)
            if isinstance(ref, Rejected):
                if debug:
                    logger.debug(
                        "report of task %d refused: %s", task.id, ref.message, extra=fields
                    )
            elif outcome.ok:
                if debug:
                    logger.debug(
                        "task %d finished on worker %s", task.id, outcome.worker_id, extra=fields
                    )
            elif outcome.released:
                # Given back by a stopping worker or broker, or an assignment that never
                # reached its worker: not a failure, and not counted (docs/DESIGN.md §6).
                logger.info(
                    "task %d attempt %d given back by worker %s (not counted against the %d "
                    "attempts allowed); queued again: %s",
                    task.id,
                    outcome.attempt,
                    outcome.worker_id,
                    task.max_attempts,
                    _given_back_reason(outcome.error),
                    extra=fields,
                )
            elif task.state == TaskState.WAITING:
                logger.info(
                    "task %d attempt %d failed on worker %s, retrying (%d attempts allowed): %s",
                    task.id,
                    outcome.attempt,
                    outcome.worker_id,
                    task.max_attempts,
                    _first_line(outcome.error),
                    extra=fields,
                )
            elif task.state == TaskState.DELAYED:
                # A retry backoff (docs/DESIGN.md §6, "Priorities and backoff"): the task
                # waits until start_after_ms, and the line says when.
                delay_s = max(0, (task.start_after_ms or state.now_ms) - state.now_ms) / 1000
                logger.info(
                    "task %d attempt %d failed on worker %s, retrying in %.3f s (backoff; %d "
                    "attempts allowed): %s",
                    task.id,
                    outcome.attempt,
                    outcome.worker_id,
                    delay_s,
                    task.max_attempts,
                    _first_line(outcome.error),
                    extra=fields,
                )
    elif debug and kind is e.AssignTasks:
        assert isinstance(entry, e.AssignTasks) and isinstance(result, list)
        for assignment, ref in zip(entry.assignments, result, strict=False):
            task = tasks.get(assignment.task_id)
            tenant = task.tenant if task is not None else ""
            fields = task_fields(assignment.task_id, tenant)
            if isinstance(ref, TaskRef) and task is not None:
                fields["attempt"] = task.attempt
                logger.debug(
                    "task %d assigned to worker %s",
                    assignment.task_id,
                    assignment.worker_id,
                    extra=fields,
                )
            elif isinstance(ref, Rejected):
                logger.debug(
                    "assignment of task %d refused: %s",
                    assignment.task_id,
                    ref.message,
                    extra=fields,
                )
    elif debug and kind is e.SubmitTasks:
        assert isinstance(entry, e.SubmitTasks)
        if isinstance(result, list):
            for spec, ref in zip(entry.tasks, result, strict=False):
                if isinstance(ref, Rejected):
                    logger.debug(
                        "task %d of a submission refused: %s",
                        spec.id,
                        ref.message,
                        extra=task_fields(spec.id, spec.tenant),
                    )
        for started in applied.assigned:  # placed by the leader in the submit itself
            logger.debug(
                "task %d assigned to worker %s",
                started.task_id,
                started.worker_id,
                extra=task_fields(
                    started.task_id, tasks[started.task_id].tenant, attempt=started.attempt
                ),
            )
    elif kind is e.CancelTask and isinstance(result, Rejected) and debug:
        assert isinstance(entry, e.CancelTask)
        task = tasks.get(entry.task_id)
        logger.debug(
            "cancel of task %d refused: %s",
            entry.task_id,
            result.message,
            extra=task_fields(entry.task_id, task.tenant if task is not None else ""),
        )
    for lost in applied.lost:
        task = tasks.get(lost.task_id)
        if task is None or task.state != TaskState.WAITING:
            continue  # failed past its max_lost: the line below says so
        logger.info(
            "task %d attempt %d lost with worker %s (lost %d of max_lost %d, not counted "
            "against the %d attempts allowed); queued again: %s",
            task.id,
            lost.attempt,
            lost.worker_id,
            task.lost,
            task.max_lost,
            task.max_attempts,
            _first_line(task.error),
            extra=task_fields(task.id, task.tenant, attempt=lost.attempt),
        )
    for task_id in applied.final_ids:
        task = tasks.get(task_id)
        # Finished tasks were logged (at DEBUG) with their report above.
        if task is None or task.state == TaskState.FINISHED:
            continue
        fields = task_fields(task_id, task.tenant, attempt=task.attempt)
        if task.state == TaskState.ERROR:
            logger.info(
                "task %d failed for good after %d attempts: %s",
                task_id,
                task.attempt,
                _first_line(task.error),
                extra=fields,
            )
        elif task.state == TaskState.CANCELLED:
            logger.info("task %d cancelled: %s", task_id, _first_line(task.error), extra=fields)
    for root in applied.trees_ended:
        tree = state.trees.get(root)
        if tree is None:
            continue
        logger.info(
            "task tree of root %d %s (run %d)%s",
            root,
            tree.state,
            tree.attempt,
            f": {tree.reason}" if tree.reason else "",
            extra=task_fields(root, tree.tenant),
        )
