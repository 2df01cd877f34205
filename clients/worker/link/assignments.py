"""Assigned tasks on the worker's side of the link: what the Hello lists, the Welcome's
drops, starting them, their deadlines and their reports (see
``clients/worker/link/worker_link.py``).
Everything here runs on the event loop's thread but :meth:`Assignments.report_from_thread`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from broker.observability.logs import task_fields
from clients.worker.link.reports import ReportOutbox
from clients.worker.runtime.task_runtime import TaskKey, TaskRuntime
from wire.worker_protocol import AssignedTask, TaskAttempt, TaskReport, Welcome

# One logger for all of the link's parts (operators and tests filter on this name).
logger = logging.getLogger("clients.worker.link")


class Assignments:
    """Assigned tasks from the Hello to their reports: reconciles with the Welcome, starts
    the tasks an Assign names, cancels each at its deadline by a local timer and hands
    each report (from a task thread) to the outbox. ``loop`` is set when the worker runs."""

    def __init__(self, runtime: TaskRuntime, reports: ReportOutbox) -> None:
        self._runtime = runtime
        self._reports = reports
        self.loop: asyncio.AbstractEventLoop | None = None
        self._deadlines: dict[TaskKey, asyncio.TimerHandle] = {}

    def held(self) -> tuple[TaskAttempt, ...]:
        """What to reconcile: attempts still running, and attempts that finished while
        disconnected whose report the broker has not acknowledged. The broker must keep
        the latter as running on this worker so the resent report finishes them; left
        out, a new leader would re-queue them and run them twice."""
        held = {(ta.task_id, ta.attempt): ta for ta in self._runtime.running()}
        for task_id, attempt in self._reports.unacked:
            held.setdefault((task_id, attempt), TaskAttempt(task_id, attempt))
        return tuple(held[key] for key in sorted(held))

    def reconcile(self, welcome: Welcome) -> None:
        """The Welcome's answer to the Hello: cancel the attempts it drops."""
        for ta in welcome.drop:
            # Already re-queued or over at the broker: a report would only be stale.
            if self._runtime.cancel((ta.task_id, ta.attempt), "dropped by broker", report=False):
                logger.info(
                    "dropping task %d attempt %d (broker's Welcome)", ta.task_id, ta.attempt
                )
        listed = {(ta.task_id, ta.attempt) for ta in (*welcome.keep, *welcome.drop)}
        unlisted = [ta for ta in self._runtime.running() if (ta.task_id, ta.attempt) not in listed]
        if unlisted:
            logger.warning("Welcome neither keeps nor drops %s; keeping them", unlisted)

    def on_assign(self, tasks: Iterable[AssignedTask], *, stopping: bool) -> None:
        # Runs for one task process leave in one write when a frame assigns several.
        with self._runtime.batched():
            self._start(tasks, stopping=stopping)

    def disarm(self, key: TaskKey) -> None:
        """The attempt reported: its deadline no longer matters."""
        handle = self._deadlines.pop(key, None)
        if handle is not None:
            handle.cancel()

    def close(self) -> None:
        for handle in self._deadlines.values():
            handle.cancel()
        self._deadlines.clear()

    def _start(self, tasks: Iterable[AssignedTask], *, stopping: bool) -> None:
        for task in tasks:
            key = (task.task_id, task.attempt)
            if self._runtime.is_known(key) or key in self._reports.unacked:
                # A repeat (e.g. the broker resent it): the running attempt or its
                # pending report stands.
                logger.debug(
                    "ignoring repeated assignment of task %d attempt %d",
                    *key,
                    extra=task_fields(task.task_id, task.tenant, attempt=task.attempt),
                )
                if key in self._reports.unacked:
                    self._reports.send([key])
                continue
            if stopping:
                self._on_report(
                    TaskReport(
                        task.task_id,
                        task.attempt,
                        ok=False,
                        error="given back: worker stopping",
                        released=True,  # not this task's failure: another worker runs it
                    )
                )
                continue
            for older in self._runtime.older_attempts(task.task_id, task.attempt):
                self._runtime.cancel(older, f"superseded by attempt {task.attempt}")
            if not self._runtime.start(task):
                continue
            if task.deadline_ms is not None:
                self._arm_deadline(key, task.deadline_ms)

    def _arm_deadline(self, key: TaskKey, deadline_ms: int) -> None:
        # deadline_ms is Unix time: this assumes broker and worker clocks roughly agree
        # (NTP); the broker enforces deadlines too.
        assert self.loop is not None
        delay_s = max(0.0, deadline_ms / 1000 - time.time())
        self._deadlines[key] = self.loop.call_later(delay_s, self._deadline_passed, key)

    def log_fields(self, key: TaskKey) -> dict[str, object]:
        ctx = self._runtime.context(key)
        return task_fields(key[0], ctx.tenant if ctx is not None else "", attempt=key[1])

    def _deadline_passed(self, key: TaskKey) -> None:
        self._deadlines.pop(key, None)
        fields = self.log_fields(key)
        if self._runtime.cancel(key, "deadline exceeded"):
            logger.info("task %d attempt %d passed its deadline", *key, extra=fields)

    # -- reports --

    def report_from_thread(self, report: TaskReport) -> None:
        loop = self.loop
        if loop is None:
            logger.error(
                "task report before the worker ran: %s",
                report,
                extra=self.log_fields((report.task_id, report.attempt)),
            )
            return
        try:
            loop.call_soon_threadsafe(self._on_report, report)
        except RuntimeError:  # the loop is closed: the process is going away
            logger.warning(
                "dropping the report of task %d: event loop closed",
                report.task_id,
                extra=self.log_fields((report.task_id, report.attempt)),
            )

    def _on_report(self, report: TaskReport) -> None:
        key = (report.task_id, report.attempt)
        self._runtime.forget(key)
        self.disarm(key)
        self._reports.add(report)
