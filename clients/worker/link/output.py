"""Task output shipped to the broker over the worker link (``GET /api/v1/tasks/{id}/logs``).

To a broker whose Welcome takes it: each running attempt's new output goes out in an
Output frame at most once a second, and an ended attempt's whole kept tail just before its
report, on every connection the report is sent on; a FetchOutput is answered from what
the runtime still holds. What went out on a connection is that connection's state.

The same loop sends each running attempt's latest ``ctx.progress`` in a Progress frame
when it changed, at most once a second, to a broker whose Welcome takes them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

from clients.worker.runtime.task_runtime import TaskKey, TaskRuntime, split_dropped_note
from wire.worker_protocol import MAX_OUTPUT_BYTES, FetchOutput, Output, Progress

if TYPE_CHECKING:
    from clients.worker.link.connection import Connection

_OUTPUT_INTERVAL_S: Final = 1.0  # running attempts' new output goes out at most this often


class TaskOutputs:
    """Sends the runtime's task output on a connection (on the event loop's thread)."""

    def __init__(self, runtime: TaskRuntime) -> None:
        self._runtime = runtime

    async def loop(self, conn: Connection) -> None:
        """Send running attempts' new output, at most once per interval each."""
        if not conn.takes_output and not conn.takes_progress:
            return
        while not conn.closed:
            await asyncio.sleep(_OUTPUT_INTERVAL_S)
            running = {(ta.task_id, ta.attempt) for ta in self._runtime.running()}
            if conn.takes_output:
                for key in [k for k in conn.output_sent if k not in running]:
                    del conn.output_sent[key]
                for key in running:
                    if key not in conn.final_output_sent:
                        self.send_live(conn, key)
            if conn.takes_progress:
                self.send_progress(conn, running)

    def send_progress(self, conn: Connection, running: set[TaskKey]) -> None:
        """Send each running attempt's latest progress report, if not sent here yet."""
        for key in [k for k in conn.progress_sent if k not in running]:
            del conn.progress_sent[key]
        for key in running:
            ctx = self._runtime.context(key)
            latest = ctx.latest_progress() if ctx is not None else None
            if latest is None or conn.progress_sent.get(key) == latest[0]:
                continue
            count, fraction, message = latest
            conn.send(Progress(task_id=key[0], attempt=key[1], fraction=fraction, message=message))
            conn.progress_sent[key] = count

    def send_live(self, conn: Connection, key: TaskKey) -> bool:
        """Send what is new of a running attempt's output; False: it has none here."""
        sent = conn.output_sent.get(key)
        live = self._runtime.live_output(key, since=sent or 0)
        if live is None:
            return False
        start, data = live
        end = start + len(data)
        if sent is not None and end <= sent:
            return True  # nothing new (or the attempt's output was just taken: it ended)
        if len(data) > MAX_OUTPUT_BYTES:
            start, data = end - MAX_OUTPUT_BYTES, data[-MAX_OUTPUT_BYTES:]
        conn.send(Output(task_id=key[0], attempt=key[1], offset=start, data=data))
        conn.output_sent[key] = end
        return True

    def send_final(self, conn: Connection, key: TaskKey, *, before_report: bool = True) -> bool:
        """Send an ended attempt's whole kept output; False: the worker holds none.
        ``before_report``: remembered until the report's FinishAck (not resent)."""
        output = self._runtime.output(key)
        if output is None:
            return False
        start, data = split_dropped_note(output)
        if len(data) > MAX_OUTPUT_BYTES:
            start += len(data) - MAX_OUTPUT_BYTES
            data = data[-MAX_OUTPUT_BYTES:]
        conn.send(Output(task_id=key[0], attempt=key[1], offset=start, data=data, complete=True))
        if before_report:
            conn.final_output_sent.add(key)
        conn.output_sent.pop(key, None)
        return True

    def on_fetch(self, conn: Connection, message: FetchOutput) -> None:
        for ta in message.tasks:
            key = (ta.task_id, ta.attempt)
            if self.send_final(conn, key, before_report=False):
                continue
            conn.output_sent.pop(key, None)  # the broker lacks it: send all that is kept
            if not self.send_live(conn, key):
                conn.send(Output(task_id=ta.task_id, attempt=ta.attempt, missing=True))
