"""A scriptable fake worker for tests: one asyncio TCP connection speaking wire.worker_protocol.

It does only what a test tells it to (send Hello, Heartbeats, Finish reports,
raw bytes) and records everything the broker sends. Every read is bounded by
a timeout, so a missing message fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from wire import worker_protocol as p

DEFAULT_TIMEOUT_S = 3.0

M = TypeVar("M", bound=p.Message)


class FakeWorker:
    def __init__(
        self,
        port: int,
        worker_id: str = "w1",
        *,
        host: str = "127.0.0.1",
        process_id: str = "proc-1",
        task_types: dict[str, int] | None = None,
        resources: dict[str, float] | None = None,
        tenants: tuple[str, ...] = (),
        token: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.worker_id = worker_id
        self.process_id = process_id
        self.task_types = {"*": 4} if task_types is None else task_types
        self.resources = resources or {}
        self.tenants = tenants
        self.token = token
        self.heartbeats_received = 0
        self.welcome: p.Welcome | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._inbox: asyncio.Queue[p.Message | None] = asyncio.Queue()
        self._stash: list[p.Message] = []  # received, not yet taken by expect()
        self._eof = asyncio.Event()
        self._read_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.decode_error: p.ProtocolError | None = None

    # --- connection ----------------------------------------------------------------------

    async def connect(self) -> None:
        reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), DEFAULT_TIMEOUT_S
        )
        self._inbox = asyncio.Queue()
        self._stash = []
        self._eof = asyncio.Event()
        self._read_task = asyncio.create_task(self._read_loop(reader))

    async def hello(
        self,
        running: Iterable[tuple[int, int]] = (),
        *,
        heartbeats: bool = True,
        heartbeat_interval_s: float = 0.1,
        wait_s: float = DEFAULT_TIMEOUT_S,
        lists_unacked: bool = False,
    ) -> p.Welcome:
        """Connect if needed, send Hello, return the Welcome; then heartbeat unless told not to."""
        if self._writer is None:
            await self.connect()
        self.send(
            p.Hello(
                worker_id=self.worker_id,
                process_id=self.process_id,
                version="test",
                task_types=dict(self.task_types),
                resources=dict(self.resources),
                tenants=self.tenants,
                running=tuple(p.TaskAttempt(t, a) for t, a in running),
                token=self.token,
                lists_unacked=lists_unacked,
            )
        )
        self.welcome = await self.expect(p.Welcome, wait_s=wait_s)
        if heartbeats:
            self.start_heartbeats(heartbeat_interval_s)
        return self.welcome

    def start_heartbeats(self, interval_s: float = 0.1) -> None:
        self.stop_heartbeats()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(interval_s))

    def stop_heartbeats(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None

    async def close(self) -> None:
        """Drop the connection (like a crashed process: no goodbye)."""
        self.stop_heartbeats()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await asyncio.wait_for(writer.wait_closed(), DEFAULT_TIMEOUT_S)
        task, self._read_task = self._read_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- sending -------------------------------------------------------------------------

    def send(self, message: p.Message) -> None:
        self.send_raw(p.encode_message(message))

    def send_raw(self, data: bytes) -> None:
        assert self._writer is not None, "not connected"
        self._writer.write(data)

    def finish(self, *reports: p.TaskReport) -> None:
        self.send(p.Finish(reports=reports))

    def finish_ok(self, task_id: int, attempt: int, result: bytes = b"null") -> None:
        self.finish(p.TaskReport(task_id=task_id, attempt=attempt, ok=True, result=result))

    def finish_failed(self, task_id: int, attempt: int, error: str) -> None:
        self.finish(p.TaskReport(task_id=task_id, attempt=attempt, ok=False, error=error))

    # --- receiving -----------------------------------------------------------------------

    async def expect(
        self,
        kind: type[M],
        where: Callable[[M], bool] | None = None,
        *,
        wait_s: float = DEFAULT_TIMEOUT_S,
    ) -> M:
        """The first received message of this type (and matching ``where``) within wait_s.

        Other messages are kept for later calls, so the order in which unrelated
        frames (an Assign, a FinishAck) arrive does not matter.
        """

        def matches(message: p.Message) -> bool:
            return isinstance(message, kind) and (where is None or where(message))

        for index, message in enumerate(self._stash):
            if matches(message):
                del self._stash[index]
                assert isinstance(message, kind)
                return message
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.worker_id}: no {kind.__name__} within {wait_s} s; "
                    f"received meanwhile: {self._stash}"
                )
            try:
                received = await asyncio.wait_for(self._inbox.get(), left)
            except TimeoutError:
                continue
            if received is None:
                self._inbox.put_nowait(None)  # keep reporting the end
                raise ConnectionError(
                    f"{self.worker_id}: connection closed while waiting for {kind.__name__}; "
                    f"received: {self._stash}"
                )
            if matches(received):
                assert isinstance(received, kind)
                return received
            self._stash.append(received)

    async def expect_none(
        self, kind: type[M], where: Callable[[M], bool] | None = None, *, within: float = 0.3
    ) -> None:
        """Fail if a message of this type (matching ``where``) arrives within ``within`` s."""
        with contextlib.suppress(TimeoutError, ConnectionError):
            message = await self.expect(kind, where, wait_s=within)
            raise AssertionError(f"{self.worker_id}: unexpected {message}")

    async def wait_closed_by_peer(self, wait_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Wait until the broker closes the connection (EOF on our side)."""
        await asyncio.wait_for(self._eof.wait(), wait_s)

    @property
    def closed_by_peer(self) -> bool:
        return self._eof.is_set()

    # --- background ----------------------------------------------------------------------

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        decoder = p.FrameDecoder()
        try:
            while True:
                try:
                    data = await reader.read(65536)
                except (ConnectionError, OSError):
                    data = b""
                if not data:
                    return
                try:
                    messages = decoder.feed(data)
                except p.ProtocolError as exc:
                    self.decode_error = exc
                    return
                for message in messages:
                    if isinstance(message, p.Heartbeat):
                        self.heartbeats_received += 1
                    else:
                        self._inbox.put_nowait(message)
        finally:
            self._eof.set()
            self._inbox.put_nowait(None)

    async def _heartbeat_loop(self, interval_s: float) -> None:
        seq = 0
        while self._writer is not None and not self._writer.is_closing():
            seq += 1
            with contextlib.suppress(ConnectionError, RuntimeError):
                self.send(p.Heartbeat(seq=seq))
            await asyncio.sleep(interval_s)
