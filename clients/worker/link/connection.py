"""One welcomed connection of the worker's link (clients/worker/link/worker_link.py): its
writer, the conversation it is in, the timing the broker asked for and what was sent on it.
Shared by the link's parts (output, reports), which send on it.
"""

from __future__ import annotations

import asyncio

from clients.worker.runtime.task_runtime import TaskKey
from wire.conversation import Conversation
from wire.worker_protocol import Message, Welcome, encode_message


class Connection:
    """One welcomed connection: a writer plus the timing the broker asked for."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        welcome: Welcome,
        max_frame_bytes: int,
        conversation: Conversation,
    ) -> None:
        self.writer = writer
        self.conversation = conversation  # docs/DESIGN.md §8: which frame may come when
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat_interval_s = max(0.01, welcome.heartbeat_interval_ms / 1000)
        self.heartbeat_timeout_s = max(
            self.heartbeat_interval_s, welcome.heartbeat_timeout_ms / 1000
        )
        self.broker_id = welcome.broker_id
        self.seq = 0
        self.closed = False
        self.takes_output = welcome.output  # the broker accepts Output frames
        # Per attempt, the end offset of the output already sent on this connection, and
        # the attempts whose final output was sent (each connection starts afresh: a new
        # leader holds nothing).
        self.output_sent: dict[TaskKey, int] = {}
        self.final_output_sent: set[TaskKey] = set()
        self.takes_progress = welcome.progress  # the broker accepts Progress frames
        # Per running attempt, the count of its ctx.progress reports last sent here.
        self.progress_sent: dict[TaskKey, int] = {}

    def send(self, message: Message) -> bool:
        """Queue a frame on the transport (flow control: see the heartbeat loop's drain)."""
        if self.writer.is_closing() or self.conversation.closed:
            return False
        self.conversation.send(message)
        self.writer.write(encode_message(message, self.max_frame_bytes))
        return True

    def abort(self) -> None:
        self.writer.transport.abort()
