"""The sync pipelining producer: :meth:`StewardClient.producer` (docs/API.md, "Pipelining
producer"). ``submit`` returns a ``concurrent.futures.Future`` at once; a sender thread
sends the buffered submissions in batches, one batch in flight, and resolves the futures.
The batching rules and the answers' reading are in :mod:`.producing`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
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

H = TypeVar("H")  # what a future resolves to: the client's TaskHandle


class Sender(Protocol):
    """The connection a producer sends its batches on: its client's ``_clone()``."""

    def _send(self, request: Request) -> Any: ...

    def close(self) -> None: ...


def _cancelled(future: Future[Any]) -> bool:
    # After this a future can no longer be cancelled: its task is being sent.
    try:
        return not future.set_running_or_notify_cancel()
    except RuntimeError:  # the caller resolved it themselves: not ours to send
        return True


def _set_result(future: Future[H], handle: H) -> None:
    with suppress(InvalidStateError):  # resolved by the caller meanwhile
        future.set_result(handle)


def _set_exception(future: Future[Any], error: BaseException) -> None:
    with suppress(InvalidStateError):
        future.set_exception(error)


class Producer(Generic[H]):
    """Submissions batched in the background; use it as a context manager (exit flushes
    and closes, even when the block raises, as Kafka's producer does).

    One batch is in flight at a time while the next one fills, so tasks submitted from one
    thread are created in submit order (their ids increase in that order)."""

    def __init__(
        self,
        connect: Callable[[], Sender],
        handle: Callable[[int, str], H],
        *,
        linger_ms: float,
        max_batch: int,
        max_buffered: int,
        max_block_s: float,
    ) -> None:
        check_options(max_block_s)
        self._buffer: Buffer[Future[H]] = Buffer(linger_ms, max_batch, max_buffered)
        self._max_block_s = max_block_s
        self._handle = handle  # (task id, state) -> the handle a future resolves to
        # Its own connection: the sender thread never shares one with the caller's thread.
        self._sender = connect()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="steward-producer", daemon=True)
        self._thread.start()

    def __enter__(self) -> Producer[H]:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def submit(
        self, type: str, params: Any = None, *, tenant: str | None = None, **options: Any
    ) -> Future[H]:
        """Queue one task (the options of :meth:`StewardClient.submit`); the future resolves
        to its TaskHandle once it is durable, or to the StewardError that refused it. Blocks
        up to ``max_block_s`` while ``max_buffered`` submissions wait to be sent, then
        raises ProducerFullError; a task the client can tell is invalid raises at once."""
        body = encode_task(type, params, tenant, options)
        future: Future[H] = Future()
        buffer = self._buffer
        with self._cond:
            if buffer.full and not buffer.closed:
                deadline = time.monotonic() + self._max_block_s
                while buffer.full and not buffer.closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ProducerFullError(buffer.max_buffered, self._max_block_s)
                    self._cond.wait(remaining)
            if buffer.closed:
                raise ProducerClosedError()
            if buffer.add(body, future, time.monotonic()):
                self._cond.notify_all()
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Send what was submitted so far without lingering, and wait until all of it is
        resolved; TimeoutError if not within ``timeout`` seconds."""
        with self._cond:
            upto = self._buffer.submitted
            self._buffer.flush_to = max(self._buffer.flush_to, upto)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._buffer.flushed(upto), timeout):
                raise TimeoutError(f"the producer's submissions not resolved within {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the sender and close its connection; later submits raise
        ProducerClosedError."""
        with self._cond:
            self._buffer.closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the producer's submissions not resolved within {timeout} s")
        self._sender.close()

    def _run(self) -> None:
        buffer = self._buffer
        while True:
            with self._cond:
                while not buffer.due(now := time.monotonic()):
                    if buffer.closed and not buffer.pending:
                        return
                    self._cond.wait(buffer.wait_s(now))
                batch = buffer.take(_cancelled)
                self._cond.notify_all()  # room for blocked submitters
            if batch is not None:
                upto = batch.upto
                self._deliver(batch)
                with self._cond:
                    buffer.done(upto)
                    self._cond.notify_all()

    def _deliver(self, batch: Batch[Future[H]] | None) -> None:
        handle = self._handle
        while batch is not None:
            try:
                # The client's retries (not_leader, 503, next URL) resend the same bytes
                # under the same key until failover_timeout_s.
                answer: Any = self._sender._send(batch.request())
            except Exception as exc:  # every future resolves, whatever went wrong
                answer = exc
            outcomes, batch = batch.settle(answer, handle)
            resolve_all(outcomes, _set_result, _set_exception)
