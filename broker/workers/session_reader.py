"""A welcomed connection's read path: frames dispatched as the bytes arrive.

After the handshake the leader stops reading a worker's connection through its
``asyncio.StreamReader`` (a task woken for every read, a copy into the reader's buffer)
and sets this :class:`asyncio.Protocol` on the transport instead: ``data_received`` feeds
the session's decoder and hands each message to the link at once, and the connection's
handler task sleeps until the connection is lost. With 10,000 idle workers beating, the
wake-ups were most of the cost of reading their heartbeats (docs/DESIGN.md §8,
"Heartbeats at scale"; docs/BENCHMARKS.md "One leader, 10,000 workers").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from broker.workers.session import Clock, Session, send_error
from wire import worker_protocol as p

# One logger for all of the worker link's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.workers.worker_link")

#: What the link does with one received message (may close the session).
Dispatch = Callable[[Session, p.Message], None]


class SessionReader(asyncio.Protocol):
    """Reads one welcomed session's frames; :attr:`done` resolves when the connection is
    lost or the session closed (on a protocol error, after its Error frame)."""

    def __init__(
        self, session: Session, decoder: p.FrameDecoder, dispatch: Dispatch, clock: Clock
    ) -> None:
        self.session = session
        self.decoder = decoder
        self.dispatch = dispatch
        self.clock = clock
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def take_over(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: Session,
        decoder: p.FrameDecoder,
        dispatch: Dispatch,
        clock: Clock,
    ) -> SessionReader:
        """Set a reader on ``writer``'s transport in place of ``reader``; the bytes the
        stream reader already holds (sent right after the Hello) are read first."""
        this = cls(session, decoder, dispatch, clock)
        # The worker closed its side already (its EOF went to the stream reader).
        closed_by_peer = reader.at_eof()
        writer.transport.set_protocol(this)
        # The stream reader gets nothing more now: end it and take what it holds (no
        # wait, so nothing the new protocol receives can come before it).
        reader.feed_eof()
        held = await reader.read()
        if held:
            this.data_received(held)
        if closed_by_peer or writer.transport.is_closing():
            this._finish()
        return this

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session.closed:
            return  # what follows a worker's Error is not read
        session.last_seen = self.clock()
        try:
            for message in self.decoder.feed(data):
                self.dispatch(session, message)
                if session.closed:
                    break
        except p.ProtocolError as exc:
            logger.warning("worker %s at %s: %s", session.worker_id, session.peer, exc.message)
            send_error(session.writer, exc.code, exc.message)
            session.close()
        if session.closed:
            self._finish()

    def eof_received(self) -> bool | None:
        self._finish()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
