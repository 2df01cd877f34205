"""The welcomed connection's read path (broker/workers/session_reader.py) over real TCP.

A server reads part of what a client sent through its StreamReader (as the handshake
does), then hands the connection to a SessionReader: the bytes the stream reader held
are dispatched first, later frames as they arrive, a bad frame is answered with an Error
frame and ends the reading, and so does the peer's close. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from broker.workers.session import Session
from broker.workers.session_reader import SessionReader
from tests.support.worker_harness import until
from wire import worker_protocol as p
from wire.conversation import Conversation, Role, State

WAIT_S = 5.0


@dataclass
class Served:
    """The server side of one connection, once taken over."""

    dispatched: list[p.Message] = field(default_factory=list)
    reader: SessionReader | None = None
    session: Session | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


def frame(message: p.Message) -> bytes:
    return p.encode_message(message)


def clock() -> float:
    return 42.0


async def serve_one(
    served: Served, prefix_bytes: int, held_bytes: int, held_eof: bool = False
) -> tuple[asyncio.Server, int]:
    """A server that reads ``prefix_bytes`` through the stream reader (into the decoder,
    as the handshake leaves a frame's start there) and takes over once the stream reader
    holds ``held_bytes`` more (and, with ``held_eof``, the peer's end)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = p.FrameDecoder()
        assert decoder.feed(await reader.readexactly(prefix_bytes)) == []
        # The stream reader's buffer is private; read here only to make the test certain.
        held: bytearray = getattr(reader, "_buffer")  # noqa: B009
        await until(lambda: len(held) >= held_bytes)
        if held_eof:
            await until(reader.at_eof)
        session = Session(
            "w1", writer, p.DEFAULT_MAX_FRAME_BYTES, now=0.0,
            conversation=Conversation(Role.BROKER, State.ACTIVE),
        )  # fmt: skip

        def dispatch(session: Session, message: p.Message) -> None:
            session.conversation.receive(message)
            served.dispatched.append(message)
            if isinstance(message, p.Error):
                session.close()

        served.session = session
        served.reader = await SessionReader.take_over(
            reader, writer, session, decoder, dispatch, clock
        )
        served.ready.set()
        await served.reader.done
        session.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def connection(
    first: bytes = b"", prefix_bytes: int = 0, half_close: bool = False
) -> AsyncIterator[tuple[Served, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client connected to :func:`serve_one` that sent ``first`` before the take-over
    (``prefix_bytes`` of it read by the server itself, the rest held by its stream reader)
    and, with ``half_close``, closed its side after it."""
    served = Served()
    server, port = await serve_one(served, prefix_bytes, len(first) - prefix_bytes, half_close)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(first)
            if half_close:
                writer.write_eof()
            await writer.drain()
            await asyncio.wait_for(served.ready.wait(), WAIT_S)
            yield served, reader, writer
        finally:
            writer.close()


async def send_and_wait_for_the_end(
    served: Served, writer: asyncio.StreamWriter, data: bytes
) -> None:
    writer.write(data)
    await writer.drain()
    assert served.reader is not None
    await asyncio.wait_for(served.reader.done, WAIT_S)


async def test_bytes_the_stream_reader_held_come_first_then_frames_as_they_arrive() -> None:
    # The server reads 3 bytes of the first frame itself: the rest, and the whole second
    # frame, sit in its stream reader when the SessionReader takes over.
    sent = frame(p.Heartbeat(seq=1)) + frame(p.Heartbeat(seq=2))
    async with connection(sent, prefix_bytes=3) as (served, _, writer):
        await until(lambda: len(served.dispatched) == 2)
        assert [m.seq for m in served.dispatched if isinstance(m, p.Heartbeat)] == [1, 2]
        assert served.session is not None and served.session.last_seen == 42.0
        writer.write(frame(p.Heartbeat(seq=3)))
        await writer.drain()
        await until(lambda: len(served.dispatched) == 3)
        writer.close()
        assert served.reader is not None
        await asyncio.wait_for(served.reader.done, WAIT_S)


async def test_a_bad_frame_is_answered_with_an_error_and_ends_the_reading() -> None:
    async with connection() as (served, reader, writer):
        # A worker may not send Assign: the conversation table refuses it.
        bad = frame(p.Heartbeat(seq=1)) + frame(p.Assign()) + frame(p.Heartbeat(seq=2))
        await send_and_wait_for_the_end(served, writer, bad)
        answer = p.FrameDecoder().feed(await asyncio.wait_for(reader.read(), WAIT_S))
        assert [type(m) for m in answer] == [p.Error]
        assert isinstance(answer[0], p.Error) and answer[0].code == "unexpected_message"
        # Nothing after the refused frame was dispatched.
        assert [type(m) for m in served.dispatched] == [p.Heartbeat]


async def test_what_follows_a_workers_error_frame_is_not_read() -> None:
    async with connection() as (served, reader, writer):
        last = frame(p.Error(code="bye", message="stopping")) + frame(p.Heartbeat(seq=9))
        await send_and_wait_for_the_end(served, writer, last)
        assert [type(m) for m in served.dispatched] == [p.Error]
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed, no answer


async def test_the_peers_close_ends_the_reading() -> None:
    async with connection() as (served, _, writer):
        writer.close()
        assert served.reader is not None
        await asyncio.wait_for(served.reader.done, WAIT_S)
        assert served.dispatched == []


async def test_a_peer_that_closed_its_side_before_the_take_over_ends_the_reading() -> None:
    # (Frames sent just before that close are read, and the end is then seen only by the
    # heartbeat timeout: the stream reader does not tell an end behind held bytes.)
    async with connection(half_close=True) as (served, _, _):
        assert served.reader is not None
        await asyncio.wait_for(served.reader.done, WAIT_S)
        assert served.dispatched == []
