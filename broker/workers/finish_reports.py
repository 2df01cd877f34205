"""Turning a worker's finish report into the outcome the leader logs.

A report's result must be JSON within the size limit, and the children it spawns must be
admitted as a submit's tasks are (broker/core/admission.py: valid specs within the limits,
built-in params included, using code the tenant may use) and, with tenant isolation, in the
task's own tenant; otherwise the task fails with the reason, rather than the
connection (its worker would resend the same report after reconnecting). Children get
their ids when the leader makes the entry (:func:`stamp_ids`).

The asyncio side (queueing, logging in batches through the node, acknowledging) is
:mod:`broker.workers.finish_queue`; this module stays pure so it is tested without a loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgspec

from broker.core import StateMachine
from broker.core import entries as e
from broker.core.admission import admission_problem
from broker.observability.logs import task_fields
from wire import worker_protocol as p

if TYPE_CHECKING:
    from broker.replication.node import Stamp
    from broker.workers.link_config import WorkerLinkConfig

# One logger for all of the worker link's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.workers.worker_link")


class InvalidSpawn(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def outcome(
    config: WorkerLinkConfig, state: StateMachine, worker_id: str, report: p.TaskReport
) -> e.TaskOutcome:
    """The outcome of a report for an attempt running on ``worker_id``."""
    result = report.result
    error = report.error
    ok = report.ok
    if ok:
        if result is None:
            result = b"null"
        elif len(result) > config.max_result_bytes:
            ok, result, error = False, None, "result too large for the broker"
        else:
            try:
                msgspec.json.decode(result)
            except msgspec.DecodeError:
                ok, result, error = False, None, "the worker sent a result that is not JSON"
    spawn: tuple[e.Spawn, ...] = ()
    if ok and report.spawn:
        try:
            spawn = spawn_requests(config, state, report)
        except InvalidSpawn as exc:
            task = state.tasks.get(report.task_id)
            logger.warning(
                "worker %s: task %d: %s",
                worker_id,
                report.task_id,
                exc.message,
                extra=task_fields(report.task_id, task.tenant if task is not None else ""),
            )
            ok, result, error = False, None, exc.message
    return e.TaskOutcome(
        task_id=report.task_id,
        worker_id=worker_id,
        attempt=report.attempt,
        ok=ok,
        result=result if ok else None,
        error=None if ok else (error or "task failed")[:65536],
        spawn=spawn,
        released=report.released and not ok,
    )


def spawn_requests(
    config: WorkerLinkConfig, state: StateMachine, report: p.TaskReport
) -> tuple[e.Spawn, ...]:
    """The children a report asks for, ids left 0 for the leader to stamp.

    Raises InvalidSpawn: the task then fails with that error rather than the
    connection (its worker would resend the same report after reconnecting).
    """
    limit = config.max_spawns_per_report
    if len(report.spawn) > limit:
        raise InvalidSpawn(f"invalid spawn: {len(report.spawn)} children, at most {limit}")
    parent = state.tasks.get(report.task_id)
    if parent is None:  # cannot happen: checked running just before
        raise InvalidSpawn("invalid spawn: the parent task is gone")
    out: list[e.Spawn] = []
    for index, request in enumerate(report.spawn):
        where = f"invalid spawn #{index} (type {request.type!r})"
        if not request.tracked and request.anchors:
            raise InvalidSpawn(f"{where}: an untracked child takes no anchors")
        if not request.tracked and request.anchor_spawns:
            raise InvalidSpawn(f"{where}: an untracked child takes no anchors")
        if any(a <= 0 for a in request.anchors):
            raise InvalidSpawn(f"{where}: anchors must be task ids")
        for sibling in request.anchor_spawns:
            if not 0 <= sibling < index:
                raise InvalidSpawn(f"{where}: anchor_spawns must name earlier children")
            if not report.spawn[sibling].tracked:
                raise InvalidSpawn(f"{where}: anchored to child #{sibling}, which is untracked")
        foreign = [a for a in request.anchors if not _same_tree(state, a, parent.root)]
        if foreign and parent.root is not None:
            # Refused here, on the task, rather than failing its tree at apply.
            raise InvalidSpawn(
                f"{where}: anchor {foreign[0]} is not a task of this task's tree "
                f"(root {parent.root})"
            )
        tenant = request.tenant if request.tenant is not None else parent.tenant
        if config.tenant_isolation and tenant != parent.tenant:
            raise InvalidSpawn(f"{where}: a task spawns children in its own tenant only")
        spec = e.TaskSpec(
            id=0,
            type=request.type,
            tenant=tenant,
            params=request.params,
            slot=request.slot,
            max_attempts=request.max_attempts,
            max_lost=request.max_lost,
            deadline_ms=request.deadline_ms,
            start_after_ms=request.start_after_ms,
            resources=dict(request.resources),
            code=request.code if request.code is not None else parent.code,
        )
        # The same rule as a submit's, built-in params included (broker/core/admission.py).
        problem = admission_problem(state, spec, code_owners_enforced=config.tenant_isolation)
        if problem is not None:
            raise InvalidSpawn(f"{where}: {problem.message}")
        anchors: tuple[int, ...] = ()
        if request.tracked:
            own = (report.task_id,) if request.anchor_self else ()
            # Earlier children as -(index + 1) until stamp_ids knows their ids.
            siblings = tuple(-(i + 1) for i in request.anchor_spawns)
            anchors = tuple(dict.fromkeys(own + request.anchors + siblings))
        out.append(e.Spawn(task=spec, anchors=anchors))
    return tuple(out)


def stamp_ids(stamp: Stamp, outcomes: tuple[e.TaskOutcome, ...]) -> tuple[e.TaskOutcome, ...]:
    """Give the children of each outcome their ids: the leader's, when the entry is made."""
    count = sum(len(o.spawn) for o in outcomes)
    if not count:
        return outcomes
    ids = iter(stamp.task_ids(count))
    return tuple(
        msgspec.structs.replace(outcome, spawn=_stamped(outcome.spawn, ids))
        if outcome.spawn
        else outcome
        for outcome in outcomes
    )


def _stamped(spawn: tuple[e.Spawn, ...], ids: Iterator[int]) -> tuple[e.Spawn, ...]:
    """One outcome's children with their ids, anchors to earlier siblings resolved."""
    stamped: list[int] = []
    out: list[e.Spawn] = []
    for child in spawn:
        stamped.append(next(ids))
        anchors = tuple(a if a > 0 else stamped[-a - 1] for a in child.anchors)
        task = msgspec.structs.replace(child.task, id=stamped[-1])
        out.append(msgspec.structs.replace(child, task=task, anchors=anchors))
    return tuple(out)


def _same_tree(state: StateMachine, task_id: int, root: int | None) -> bool:
    task = state.tasks.get(task_id)
    return task is not None and task.root == root
