"""Task reports on their way to the broker (see ``clients/worker/link/worker_link.py``).

Finished tasks' reports are coalesced (those arriving together, or for
``finish_batch_ms`` when set) into one Finish frame and kept until a FinishAck names
them: they are sent again after every reconnect and every ``finish_resend_s`` while
connected, and reports of tasks finishing while disconnected wait for the next
connection. Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

from clients.worker.config import WorkerConfig
from clients.worker.link.output import TaskOutputs
from clients.worker.runtime.task_runtime import TaskKey
from wire.worker_protocol import Finish, TaskAttempt, TaskReport

if TYPE_CHECKING:
    from clients.worker.link.connection import Connection

# One logger for all of the link's parts (operators and tests filter on this name).
logger = logging.getLogger("clients.worker.link")

_REPORT_OVERHEAD_BYTES: Final = 64  # msgpack framing of one report besides its payload


class ReportOutbox:
    """The reports not yet acknowledged, and when each went out. ``connection`` gives the
    current welcomed connection (None: disconnected); ``loop`` is set when the worker runs."""

    def __init__(
        self,
        config: WorkerConfig,
        outputs: TaskOutputs,
        connection: Callable[[], Connection | None],
    ) -> None:
        self.config = config
        self._outputs = outputs
        self._connection = connection
        self.loop: asyncio.AbstractEventLoop | None = None
        self.unacked: dict[TaskKey, TaskReport] = {}
        self._sent_at: dict[TaskKey, float] = {}  # loop time each unacked report went out
        self._outbox: list[TaskKey] = []
        self._flush_handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self.changed = asyncio.Event()  # a report arrived or an ack: for stop()'s waits

    def add(self, report: TaskReport) -> None:
        """Hold a new report and send it soon."""
        key = (report.task_id, report.attempt)
        self.unacked[key] = report
        self._outbox.append(key)
        self.changed.set()
        if self._flush_handle is None and self.loop is not None:
            # 0 (the default): flush on the next loop turn, so reports that arrive
            # together share a frame without holding a lone report back.
            delay_s = self.config.finish_batch_ms / 1000
            self._flush_handle = (
                self.loop.call_later(delay_s, self.flush)
                if delay_s > 0
                else self.loop.call_soon(self.flush)
            )

    def acked(self, conn: Connection, tasks: Iterable[TaskAttempt]) -> None:
        """A FinishAck: the broker holds these reports."""
        for ta in tasks:
            key = (ta.task_id, ta.attempt)
            self.unacked.pop(key, None)
            self._sent_at.pop(key, None)
            conn.final_output_sent.discard(key)
        self.changed.set()

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()

    def flush(self) -> None:
        self._flush_handle = None
        keys, self._outbox = self._outbox, []
        # Disconnected: the reports stay unacknowledged and go out after the next Welcome.
        self.send(keys)

    def resend_due(self, now: float) -> None:
        due = [
            k
            for k in self.unacked
            if now - self._sent_at.get(k, 0.0) >= self.config.finish_resend_s
        ]
        if due:
            logger.debug("resending %d unacknowledged reports", len(due))
            self.send(due)

    def send(self, keys: Iterable[TaskKey]) -> None:
        conn = self._connection()
        if conn is None or self.loop is None:
            return
        now = self.loop.time()
        budget = conn.max_frame_bytes // 2
        batch: list[TaskReport] = []
        size = 0
        for key in dict.fromkeys(keys):
            report = self.unacked.get(key)
            if report is None:
                continue
            n = _REPORT_OVERHEAD_BYTES + len(report.result or b"") + len(report.error or "") * 4
            n += sum(_REPORT_OVERHEAD_BYTES + len(s.params) for s in report.spawn)
            if batch and size + n > budget:
                conn.send(Finish(reports=tuple(batch)))
                batch, size = [], 0
            if conn.takes_output and key not in conn.final_output_sent:
                # Before its report: once the broker logs the attempt over, it holds all
                # of its output (a follower of the logs stops at the end, missing nothing).
                self._outputs.send_final(conn, key)
            batch.append(report)
            size += n
            self._sent_at[key] = now
        if batch:
            conn.send(Finish(reports=tuple(batch)))
