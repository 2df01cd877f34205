"""The writer of one ledger: group commit over an asynchronous producer (package docstring)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pulsar  # type: ignore[import-untyped]

from log.api import (
    LedgerError,
    LedgerFencedError,
    LedgerWriter,
    NoSuchLedgerError,
)
from log.pulsar.client import (
    LedgerHandleStore,
    _error_for,
    _error_for_result,
    _ThreadInbox,
    logger,
)
from log.pulsar.wire import MAX_ENTRY_SIZE_BYTES, Kind, encode_entries, encode_message


class PulsarLedgerWriter(LedgerWriter):
    """The producer of one ledger's topic; see the :mod:`log.pulsar` docstring."""

    def __init__(self, store: LedgerHandleStore, ledger_id: int, producer: Any) -> None:
        self._store = store
        self._ledger_id = ledger_id
        self._producer = producer
        self._loop = asyncio.get_running_loop()
        self._next_entry_id = 0
        self._last_add_confirmed = -1
        self._size_bytes = 0
        # Appended and not resolved yet, in id order.
        self._pending: deque[tuple[int, asyncio.Future[int]]] = deque()
        # Acknowledged messages (first entry id -> last) waiting for an earlier one.
        self._acked: dict[int, int] = {}
        # Appended, not handed to the producer yet; the first of them has id _queued_from.
        self._queue: deque[bytes] = deque()
        self._queued_from = 0
        self._flush_handle: asyncio.Handle | None = None
        self._in_flight = 0  # messages sent and not acknowledged
        # Once set, the writer is dead: this error type and reason for every later append.
        self._failure: tuple[type[LedgerError], str] | None = None
        self._failed_from: int | None = None
        self._closed = False
        self._close_result: int | None = None
        self._acks = _ThreadInbox(self._loop, self._on_acks)

    def append(self, data: bytes) -> asyncio.Future[int]:
        if len(data) > MAX_ENTRY_SIZE_BYTES:
            raise ValueError(f"entry of {len(data)} bytes exceeds {MAX_ENTRY_SIZE_BYTES}")
        future: asyncio.Future[int] = self._loop.create_future()
        if self._refuse_append(future, self._failure):
            return future
        entry_id = self._next_entry_id
        self._next_entry_id += 1
        self._size_bytes += len(data)
        self._pending.append((entry_id, future))
        self._queue.append(bytes(data))
        if self._flush_handle is None:
            # On the next loop iteration: the appends made in this one share one message,
            # and a lone append is not delayed by any timer.
            self._flush_handle = self._loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        """Send what is queued, as few messages as the size limit allows (group commit)."""
        self._flush_handle = None
        max_in_flight = self._store.config.max_pending_sends
        max_bytes = self._store.config.max_message_bytes
        while self._queue and self._failure is None and self._in_flight < max_in_flight:
            batch = [self._queue.popleft()]
            batch_bytes = len(batch[0])
            while self._queue and batch_bytes + len(self._queue[0]) <= max_bytes:
                batch_bytes += len(self._queue[0])
                batch.append(self._queue.popleft())
            first_id = self._queued_from
            self._queued_from += len(batch)
            self._send(first_id, batch)

    def _send(self, first_id: int, batch: list[bytes]) -> None:
        # Stamped when handed to the producer: everything durable by then is confirmed.
        payload = encode_entries(first_id, self.lac_to_stamp(self._last_add_confirmed), batch)
        last_id = first_id + len(batch) - 1
        self._in_flight += 1
        post = self._acks.post

        def sent(result: Any, message_id: Any) -> None:  # on a client thread
            post((first_id, last_id, result))

        try:
            self._producer.send_async(payload, sent)
        except Exception as exc:
            self._in_flight -= 1
            error = _error_for(exc, f"ledger {self._ledger_id}: send of entry {first_id}")
            self._fail_from(first_id, type(error), str(error))

    def _on_acks(self, acks: list[tuple[int, int, Any]]) -> None:
        for first_id, last_id, result in acks:
            self._in_flight -= 1
            if self._failed_from is not None and first_id >= self._failed_from:
                continue  # already failed (fenced or an earlier send failed): stays failed
            if result == pulsar.Result.Ok:
                self._acked[first_id] = last_id
            else:
                error = _error_for_result(result, f"ledger {self._ledger_id}: entry {first_id}")
                if not isinstance(error, LedgerFencedError):
                    logger.error("%s", error)
                self._fail_from(first_id, type(error), str(error))
        # Messages go out in id order, so the oldest pending append starts an acked message
        # once that message is acknowledged.
        while self._pending and self._pending[0][0] in self._acked:
            last_id = self._acked.pop(self._pending[0][0])
            while self._pending and self._pending[0][0] <= last_id:
                entry_id, future = self._pending.popleft()
                # A cancelled future's entry is durable anyway; nothing to undo.
                if not future.done():
                    future.set_result(entry_id)
            self._last_add_confirmed = last_id
        if self._queue and self._flush_handle is None:
            self._flush()

    def _fail_from(self, entry_id: int, error_type: type[LedgerError], reason: str) -> None:
        """Fail ``entry_id`` and every later append, now and for good."""
        if self._failure is None:
            self._failure = (error_type, reason)
        if self._failed_from is None or entry_id < self._failed_from:
            self._failed_from = entry_id
        self._queue.clear()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        while self._pending and self._pending[-1][0] >= self._failed_from:
            _, future = self._pending.pop()
            if not future.done():
                # One instance per future: re-raising a shared exception grows its traceback.
                future.set_exception(error_type(reason))

    def fence_locally(self) -> None:
        """Recovery of this ledger by the same store: every unresolved and later append
        fails (an entry stored before the SEAL that recovery writes next stays in the
        ledger, unacknowledged)."""
        first = self._pending[0][0] if self._pending else self._next_entry_id
        self._fail_from(
            first, LedgerFencedError, f"ledger {self._ledger_id} was fenced by recovery"
        )

    def on_deleted(self) -> None:
        first = self._pending[0][0] if self._pending else self._next_entry_id
        self._fail_from(first, NoSuchLedgerError, f"ledger {self._ledger_id} was deleted")

    async def close(self) -> int:
        if self._close_result is not None:
            return self._close_result
        self._closed = True
        pending = {future for _, future in self._pending}
        if pending:
            # Bounded by the producer's send timeout. asyncio.wait does not cancel the
            # appends if close() itself is cancelled.
            await asyncio.wait(pending)
        if self._failure is None:
            try:
                await self._store.send_and_wait(
                    self._producer,
                    encode_message(Kind.SEAL, -1, self._last_add_confirmed),
                    f"ledger {self._ledger_id}: closing SEAL",
                )
            except LedgerError as exc:
                # Not fatal: recovery writes a SEAL of its own and finds the same end.
                logger.warning("%s", exc)
        await self._store.close_quietly(self._producer, f"producer of ledger {self._ledger_id}")
        self._close_result = self._last_add_confirmed
        self._store.forget(self)
        return self._close_result
