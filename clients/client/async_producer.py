"""The asyncio pipelining producer: :meth:`AsyncStewardClient.producer` (docs/API.md,
"Pipelining producer"). As aiokafka's ``send``: ``await p.submit(...)`` returns an asyncio
future at once (it waits only while the buffer is full); a sender task sends batches, one in
flight, and resolves the futures. The batching rules are in :mod:`.producing`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from clients.client.api_calls import Request
from clients.client.producing import (
    Batch,
    Buffer,
    ProducerClosedError,
    ProducerFullError,
    check_options,
    encode_task,
    resolve_all,
)

H = TypeVar("H")  # what a future resolves to: the client's AsyncTaskHandle


class AsyncSender(Protocol):
    """The connections a producer sends its batches on: its client's ``_clone()``."""

    async def _send(self, request: Request) -> Any: ...

    async def aclose(self) -> None: ...


def _set_result(future: asyncio.Future[H], handle: H) -> None:
    if not future.done():  # the caller may have cancelled it meanwhile
        future.set_result(handle)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class AsyncProducer(Generic[H]):
    """The asyncio twin of :class:`clients.client.producer.Producer`: ``async with``,
    ``await flush()``, ``await aclose()``; same batching, ordering and failover."""

    def __init__(
        self,
        connect: Callable[[], AsyncSender],
        handle: Callable[[int, str], H],
        *,
        linger_ms: float,
        max_batch: int,
        max_buffered: int,
        max_block_s: float,
    ) -> None:
        check_options(max_block_s)
        self._buffer: Buffer[asyncio.Future[H]] = Buffer(linger_ms, max_batch, max_buffered)
        self._max_block_s = max_block_s
        self._handle = handle  # (task id, state) -> the handle a future resolves to
        self._sender = connect()  # its own connection pool, closed with the producer
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # for the sender: something to send
        self._progress = asyncio.Event()  # replaced on each step: waiters re-check

    async def __aenter__(self) -> AsyncProducer[H]:
        self._start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def _until(self, done: Any) -> None:
        while not done():
            await self._progress.wait()

    async def submit(
        self, type: str, params: Any = None, *, tenant: str | None = None, **options: Any
    ) -> asyncio.Future[H]:
        """Queue one task; returns a future resolving to its AsyncTaskHandle once it is
        durable, or to the StewardError that refused it (see Producer.submit)."""
        body = encode_task(type, params, tenant, options)
        buffer = self._buffer
        if buffer.full and not buffer.closed:
            try:
                async with asyncio.timeout(self._max_block_s):
                    await self._until(lambda: not buffer.full or buffer.closed)
            except TimeoutError:
                raise ProducerFullError(buffer.max_buffered, self._max_block_s) from None
        if buffer.closed:
            raise ProducerClosedError()
        self._start()
        future: asyncio.Future[H] = asyncio.get_running_loop().create_future()
        if buffer.add(body, future, asyncio.get_running_loop().time()):
            self._wake.set()
        return future

    async def flush(self) -> None:
        """Send what was submitted so far without lingering; wait until it is resolved."""
        upto = self._buffer.submitted
        self._buffer.flush_to = max(self._buffer.flush_to, upto)
        self._wake.set()
        await self._until(lambda: self._buffer.flushed(upto))

    async def aclose(self) -> None:
        """Flush, stop the sender, close its connection; later submits raise."""
        self._buffer.closed = True
        self._wake.set()
        self._step()  # submitters waiting for room see the close
        if self._task is not None:
            await self._task
        await self._sender.aclose()

    async def _run(self) -> None:
        buffer = self._buffer
        loop = asyncio.get_running_loop()
        while True:
            while not buffer.due(now := loop.time()):
                if buffer.closed and not buffer.pending:
                    return
                self._wake.clear()
                wait_s = buffer.wait_s(now)
                try:
                    async with asyncio.timeout(wait_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            batch = buffer.take(lambda future: future.done())  # cancelled: not sent
            self._step()  # room for blocked submitters
            if batch is not None:
                upto = batch.upto
                await self._deliver(batch)
                buffer.done(upto)
                self._step()

    async def _deliver(self, batch: Batch[asyncio.Future[H]] | None) -> None:
        handle = self._handle
        while batch is not None:
            try:
                answer: Any = await self._sender._send(batch.request())
            except Exception as exc:  # every future resolves, whatever went wrong
                answer = exc
            outcomes, batch = batch.settle(answer, handle)
            resolve_all(outcomes, _set_result, _set_exception)
