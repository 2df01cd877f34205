"""One connected worker, as the leader's worker link holds it (docs/DESIGN.md §8)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from wire import worker_protocol as p
from wire.conversation import Conversation, Role

# One logger for all of the worker link's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.workers.worker_link")

#: The worker link's one clock (seconds, monotonic); tests inject their own.
Clock = Callable[[], float]


class Session:
    """One connected (welcomed) worker: its writer and its side of the conversation."""

    def __init__(
        self,
        worker_id: str,
        writer: asyncio.StreamWriter,
        max_frame_bytes: int,
        credential: str | None = None,
        peer: object = None,
        *,
        now: float,
        conversation: Conversation | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.peer = peer  # the connection's address, for logs
        self.writer = writer
        self.max_frame_bytes = max_frame_bytes
        self.credential = credential  # API worker credential id; None: the shared token
        self.answers_fetch = False  # its Hello said it answers FetchOutput
        self.last_seen = now
        self.closed = False
        self.conversation = conversation or Conversation(Role.BROKER)
        # The heartbeat interval and timeout its Welcome named (broker/workers/liveness.py),
        # and when the leader last sent it a Heartbeat.
        self.heartbeat_interval_s = 1.0
        self.heartbeat_timeout_s = 10.0
        self.last_beat = now
        # Frames sent so far, and when the heartbeat loop last saw the count move: any
        # frame proves the leader alive to the worker, so a busy connection needs no beat.
        self.frames_sent = 0
        self.frames_seen = 0
        self.last_sent = now

    def send_frame(self, message: p.Message, frame: bytes) -> None:
        """Send ``message`` already encoded as ``frame`` (one encoding for many sessions)."""
        if self.closed:
            return
        try:
            self.conversation.send(message)
            self.writer.write(frame)
            self.frames_sent += 1
        except (ConnectionError, RuntimeError, p.ProtocolError) as exc:
            logger.warning("cannot send to worker %s: %s", self.worker_id, exc)
            self.close()

    def send(self, message: p.Message) -> None:
        if self.closed:
            return
        try:
            self.conversation.send(message)
            self.writer.write(p.encode_message(message, self.max_frame_bytes))
            self.frames_sent += 1
        except (ConnectionError, RuntimeError, p.ProtocolError) as exc:
            logger.warning("cannot send to worker %s: %s", self.worker_id, exc)
            self.close()

    def send_error(self, code: str, message: str) -> None:
        """Answer with an Error frame and close."""
        self.conversation.send(p.Error(code=code, message=message))
        send_error(self.writer, code, message)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


def peer_address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "unknown peer"


def send_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    """Write an Error frame and close (a connection without a session yet, or its last words)."""
    with contextlib.suppress(Exception):
        writer.write(p.encode_message(p.Error(code=code, message=message)))
        writer.close()
