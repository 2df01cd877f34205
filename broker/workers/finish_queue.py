"""Workers' finish reports on the leader: queued, logged in batches, acknowledged.

Reports from every connection queue up; one loop logs them as FinishTasks entries of at
most ``max_reports_per_entry`` and acknowledges each batch (FinishAck) once it is applied.
What a report turns into is :mod:`broker.workers.finish_reports` (docs/DESIGN.md §8).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from broker.core import TaskState
from broker.core import entries as e
from broker.observability.logs import task_fields
from broker.replication.node import BrokerUnavailableError, Node, Stamp
from broker.workers.finish_reports import outcome, stamp_ids
from broker.workers.session import Session
from wire import worker_protocol as p

if TYPE_CHECKING:
    from broker.workers.link_config import WorkerLinkConfig

# One logger for all of the worker link's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.workers.worker_link")


class FinishQueue:
    """Owns the queued reports and the loop that logs and acknowledges them."""

    def __init__(self, node: Node, config: WorkerLinkConfig, sessions: dict[str, Session]) -> None:
        self.node = node
        self.config = config
        self.sessions = sessions  # the link's: worker id -> its current connection
        self._reports: list[tuple[Session, p.TaskReport]] = []
        self._ready = asyncio.Event()

    def add(self, session: Session, reports: tuple[p.TaskReport, ...]) -> None:
        for report in reports:
            self._reports.append((session, report))
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._reports:
                limit = self.config.max_reports_per_entry
                batch, self._reports = self._reports[:limit], self._reports[limit:]
                # Reports of attempts that are already over (duplicates, late ones)
                # change nothing: acknowledge them without logging an entry.
                live: list[tuple[Session, p.TaskReport]] = []
                stale: list[tuple[Session, p.TaskReport]] = []
                for item in batch:
                    (live if self._is_running(*item) else stale).append(item)
                for session, report in stale:
                    self._log_foreign_report(session, report)
                if stale:
                    self._acknowledge(stale)
                batch = live
                if not batch:
                    continue
                outcomes = tuple(
                    outcome(self.config, self.node.state, session.worker_id, report)
                    for session, report in batch
                )

                def build(stamp: Stamp, outcomes: tuple[e.TaskOutcome, ...] = outcomes) -> e.Entry:
                    return e.finish_tasks(stamp.now_ms, stamp_ids(stamp, outcomes))

                try:
                    await self.node.propose(build)
                except BrokerUnavailableError:
                    # Not acknowledged: the worker resends after reconnecting.
                    self._reports.clear()
                    break
                self._acknowledge(batch)

    def _is_running(self, session: Session, report: p.TaskReport) -> bool:
        """Whether the report is for an attempt running on this very connection: the
        task's worker is the session's and the session is that worker's current one (a
        replaced connection's queued reports are not its to make)."""
        task = self.node.state.tasks.get(report.task_id)
        return (
            task is not None
            and task.state == TaskState.RUNNING
            and task.worker == session.worker_id
            and task.attempt == report.attempt
            and self.sessions.get(session.worker_id) is session
        )

    def _log_foreign_report(self, session: Session, report: p.TaskReport) -> None:
        """Log a report for an attempt running elsewhere (not a late duplicate): it is
        refused (acknowledged, so a confused worker stops resending, but not applied)."""
        task = self.node.state.tasks.get(report.task_id)
        if task is None or task.state != TaskState.RUNNING:
            return
        if task.worker == session.worker_id and self.sessions.get(session.worker_id) is session:
            return  # its own task, another attempt: a late duplicate
        logger.warning(
            "worker %s at %s: refused a report for task %d attempt %d, which runs on %s",
            session.worker_id,
            session.peer,
            report.task_id,
            report.attempt,
            "another connection" if task.worker == session.worker_id else task.worker,
            extra=task_fields(task.id, task.tenant),
        )

    def _acknowledge(self, batch: list[tuple[Session, p.TaskReport]]) -> None:
        acks: dict[Session, list[p.TaskAttempt]] = defaultdict(list)
        for session, report in batch:
            acks[session].append(p.TaskAttempt(report.task_id, report.attempt))
        for session, attempts in acks.items():
            session.send(p.FinishAck(tasks=tuple(attempts)))
