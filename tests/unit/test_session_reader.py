"""The welcomed connection's read path (broker/workers/session_reader.py) over real TCP.

A server reads part of what a client sent through its StreamReader (as the handshake
does), then hands the connection to a SessionReader: the bytes the stream reader held
are dispatched first, later frames as they arrive, a bad frame is answered with an Error
frame and ends the reading, and so does the peer's close. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from broker.workers import protocol as p
from broker.workers.conversation import Conversation, Role, State
from broker.workers.session import Session
from broker.workers.session_reader import SessionReader
from tests.support.worker_harness import until

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


@pytest.fixture
async def served() -> AsyncIterator[tuple[Served, Callable[[], float]]]:
    yield Served(), lambda: 42.0


async def serve_one(
    served: Served, clock: Callable[[], float], prefix_bytes: int, held_bytes: int = 0
) -> tuple[asyncio.Server, int]:
    """A server that reads ``prefix_bytes`` through the stream reader (into the decoder,
    as the handshake leaves a frame's start there) and takes over once the stream reader
    holds ``held_bytes`` more."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = p.FrameDecoder()
        assert decoder.feed(await reader.readexactly(prefix_bytes)) == []
        # The stream reader's buffer is private; read here only to make the test certain.
        held: bytearray = getattr(reader, "_buffer")  # noqa: B009
        await until(lambda: len(held) >= held_bytes)
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


async def test_bytes_the_stream_reader_held_come_first_then_frames_as_they_arrive(
    served: tuple[Served, Callable[[], float]],
) -> None:
    state, clock = served
    sent = frame(p.Heartbeat(seq=1)) + frame(p.Heartbeat(seq=2))
    # The server reads 3 bytes of the first frame itself: the rest, and the whole second
    # frame, sit in its stream reader when the SessionReader takes over.
    server, port = await serve_one(state, clock, prefix_bytes=3, held_bytes=len(sent) - 3)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        await writer.drain()
        await asyncio.wait_for(state.ready.wait(), WAIT_S)
        await until(lambda: len(state.dispatched) == 2)
        assert [m.seq for m in state.dispatched if isinstance(m, p.Heartbeat)] == [1, 2]
        assert state.session is not None and state.session.last_seen == 42.0
        writer.write(frame(p.Heartbeat(seq=3)))
        await writer.drain()
        await until(lambda: len(state.dispatched) == 3)
        writer.close()
        assert state.reader is not None
        await asyncio.wait_for(state.reader.done, WAIT_S)
        await writer.wait_closed()
        del reader


async def test_a_bad_frame_is_answered_with_an_error_and_ends_the_reading(
    served: tuple[Served, Callable[[], float]],
) -> None:
    state, clock = served
    server, port = await serve_one(state, clock, prefix_bytes=0)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(state.ready.wait(), WAIT_S)
        # A worker may not send Assign: the conversation table refuses it.
        writer.write(frame(p.Heartbeat(seq=1)) + frame(p.Assign()) + frame(p.Heartbeat(seq=2)))
        await writer.drain()
        assert state.reader is not None
        await asyncio.wait_for(state.reader.done, WAIT_S)
        answer = p.FrameDecoder().feed(await asyncio.wait_for(reader.read(), WAIT_S))
        assert [type(m) for m in answer] == [p.Error]
        assert isinstance(answer[0], p.Error) and answer[0].code == "unexpected_message"
        # Nothing after the refused frame was dispatched.
        assert [type(m) for m in state.dispatched] == [p.Heartbeat]
        writer.close()


async def test_what_follows_a_workers_error_frame_is_not_read(
    served: tuple[Served, Callable[[], float]],
) -> None:
    state, clock = served
    server, port = await serve_one(state, clock, prefix_bytes=0)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(state.ready.wait(), WAIT_S)
        writer.write(frame(p.Error(code="bye", message="stopping")) + frame(p.Heartbeat(seq=9)))
        await writer.drain()
        assert state.reader is not None
        await asyncio.wait_for(state.reader.done, WAIT_S)
        assert [type(m) for m in state.dispatched] == [p.Error]
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed, no answer
        writer.close()


async def test_the_peers_close_ends_the_reading(
    served: tuple[Served, Callable[[], float]],
) -> None:
    state, clock = served
    server, port = await serve_one(state, clock, prefix_bytes=0)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(state.ready.wait(), WAIT_S)
        writer.close()
        assert state.reader is not None
        await asyncio.wait_for(state.reader.done, WAIT_S)
        assert state.dispatched == []
