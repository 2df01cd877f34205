"""The reader (tailer) of one ledger's topic, through the client's Reader API (package
docstring)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pulsar  # type: ignore[import-untyped]

from log.api import (
    LedgerClosedError,
    LedgerEntry,
    LedgerError,
    LedgerReader,
    NoSuchLedgerError,
)
from log.pulsar.client import LedgerHandleStore, logger
from log.pulsar.entry_buffer import EntryBuffer
from log.pulsar.reader_thread import ReaderThread

#: A reader stops fetching while it holds more than this many bytes nobody read yet.
READER_BUFFER_BYTES = 32 * 1024 * 1024
#: Pause between attempts to re-create a reader while the broker is unreachable.
_RETRY_PAUSE_S = 0.2


class PulsarLedgerReader(LedgerReader):
    """Reads one ledger's topic through the Reader API; see the :mod:`log.pulsar` docstring.

    A :class:`~log.pulsar.reader_thread.ReaderThread` blocks in ``read_next`` and posts what
    it receives (decoded into an :class:`~log.pulsar.entry_buffer.EntryBuffer`); this class
    re-creates the client Reader after gaps and stalls and serves reads from the buffer.
    """

    def __init__(self, store: LedgerHandleStore, ledger_id: int) -> None:
        self._store = store
        self._ledger_id = ledger_id
        self._topic = store.config.topic(ledger_id)
        self._loop = asyncio.get_running_loop()
        self._reader: Any = None
        self._buf = EntryBuffer(ledger_id)  # what was received, decoded
        self._last_entry_id: int | None = None
        self._last_received_id: Any = None  # of the current generation, for ordering checks
        self._retried_at: int | None = None  # next id for which a gap already caused a restart
        self._pump_error: BaseException | None = None
        self._waiters: set[asyncio.Future[None]] = set()
        self._recreate_lock = asyncio.Lock()
        self._thread = ReaderThread(
            self._loop,
            ledger_id,
            on_message=self._accept,
            on_error=self._on_error,
            on_batch=self._on_batch,
        )
        self._closed = False
        #: How often this reader was re-created (stalls, gaps), for diagnostics and tests.
        self.recreations = 0

    @property
    def sealed_last_entry_id(self) -> int | None:
        """The last entry id once this reader has seen the ledger's SEAL, else None."""
        return self._buf.seal_last

    # -- on the loop, from the reader thread -----------------------------------------------

    def _on_error(self, error: BaseException) -> None:
        self._pump_error = error

    def _on_batch(self) -> None:
        if self._buf.buffered_bytes > READER_BUFFER_BYTES:
            self._thread.paused = True
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def _accept(self, data: bytes, message_id: Any) -> None:
        previous = self._last_received_id
        self._last_received_id = message_id
        if (
            previous is not None
            and not previous < message_id
            and self._restart_at_anomaly("a MessageId that does not increase")
        ):
            return
        gap = self._buf.accept(data, message_id)
        if gap is not None:
            self._restart_at_anomaly(gap)

    def _restart_at_anomaly(self, what: str) -> bool:
        """A gap or a reordering: start over after the last accepted message, once per
        position (True); a second time at the same position it is what is stored (False)."""
        if self._retried_at == self._buf.next_id:
            logger.info("ledger %d: %s again: it is stored that way", self._ledger_id, what)
            return False
        self._retried_at = self._buf.next_id
        logger.warning("ledger %d reader: %s; re-creating the reader", self._ledger_id, what)
        # Ignore everything else this reader delivers; a new one is created by whoever
        # waits next (the pump error below makes them do it).
        self._thread.new_generation()
        self._pump_error = _RestartReader(what)
        self._thread.answer_probes(None)
        self._wake()
        return True

    def mark_recovered(self, last_entry_id: int) -> None:
        self._last_entry_id = last_entry_id

    def mark_deleted(self) -> None:
        """The ledger was deleted by this reader's store."""
        self._buf.deleted = True
        self._wake()

    def _check_usable(self) -> None:
        if self._closed:
            raise LedgerClosedError(f"reader of ledger {self._ledger_id} is closed")
        if self._buf.deleted:
            raise NoSuchLedgerError(f"ledger {self._ledger_id} was deleted")
        if self._buf.corrupt is not None:
            raise LedgerError(
                f"topic {self._topic} of ledger {self._ledger_id}: {self._buf.corrupt}"
            )

    async def _wait_delivery(self, timeout_s: float) -> bool:
        """Wait until the reader thread delivers something (or fails); False on timeout."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=max(0.0, timeout_s))
        finally:
            self._waiters.discard(waiter)
        return waiter.done()

    async def _probe(self) -> bool | None:
        """Whether the broker holds messages this reader has not received (None: unknown).

        Answered by the reader thread after it posted everything it received before.
        """
        if not self._buf.created:
            return None  # maybe an empty topic: has_message_available fails on pulsar-lite
        if self._pump_error is not None:
            return None  # no reader thread to ask until the reader is re-created
        if self._last_received_id is None:
            # Before a reader started inclusive at a MessageId received anything, the client's
            # has_message_available seeks to that MessageId, and seek hangs on pulsar-lite.
            return None
        return await self._thread.ask(self._store.config.operation_timeout_s)

    async def start(self) -> None:
        await self._recreate("opened")

    async def _recreate(self, reason: str) -> None:
        """A new Reader from the last accepted message on (the broken one is closed)."""
        async with self._recreate_lock:
            self._check_usable()
            old = self._reader
            generation = self._thread.new_generation()
            self._reader = None
            self._last_received_id = None
            self._pump_error = None
            if old is not None:
                self.recreations += 1
                logger.info("ledger %d: re-creating its reader (%s)", self._ledger_id, reason)
                await self._store.close_quietly(old, f"reader of ledger {self._ledger_id}")
            start = self._buf.last_message_id
            config = self._store.config
            reader = await self._store.blocking(
                f"create a reader of ledger {self._ledger_id}",
                self._store.client.create_reader,
                self._topic,
                start if start is not None else pulsar.MessageId.earliest,
                receiver_queue_size=config.reader_queue_size,
                # Inclusive: pulsar-lite 0.2.0 delivers nothing to a reader started exclusive
                # of a MessageId. The message delivered again is dropped as a duplicate.
                start_message_id_inclusive=True,
            )
            if self._closed or generation != self._thread.generation:
                await self._store.close_quietly(reader, f"reader of ledger {self._ledger_id}")
                return
            self._reader = reader
            self._thread.start(reader, generation)

    async def _keep_going(self) -> bool:
        """Re-create the reader if its thread failed or an anomaly asked for it.

        False when that failed (the broker is unreachable): the caller retries while its
        own deadline allows, after a short pause taken here.
        """
        error = self._pump_error
        if error is None:
            return True
        if isinstance(error, pulsar.TopicNotFound):
            self._buf.deleted = True
            self._check_usable()
        reason = str(error) if isinstance(error, _RestartReader) else f"it failed: {error!r}"
        try:
            await self._recreate(reason)
        except NoSuchLedgerError:
            raise
        except LedgerError as exc:
            logger.warning("ledger %d: cannot re-create its reader: %s", self._ledger_id, exc)
            self._pump_error = _RestartReader(f"retrying after: {exc}")
            await asyncio.sleep(_RETRY_PAUSE_S)
            return False
        return True

    def _stalled(self, more: bool | None) -> bool:
        """Nothing arrived for a stall period although the broker has more (``more``), or
        although this reader has not received even the message it starts at."""
        if self._pump_error is not None or self._thread.paused:
            return False
        return more is True or (self._buf.created and self._last_received_id is None)

    async def wait_for_first_message(self, timeout_s: float, *, exists: bool) -> bool:
        """Whether the ledger's CREATED marker arrives within ``timeout_s``; ``exists``: the
        ledger is known to exist (a reader receiving nothing then is stuck)."""
        deadline = self._loop.time() + timeout_s
        stall_s = self._store.config.reader_stall_s
        while not self._buf.created:
            self._check_usable()
            await self._keep_going()
            remaining_s = deadline - self._loop.time()
            if remaining_s <= 0:
                return False
            if not await self._wait_delivery(min(remaining_s, stall_s)) and exists:
                # The topic has a first message: a reader that receives nothing is stuck.
                self._pump_error = _RestartReader("stalled before its first message")
        return True

    async def settle(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Receive what the broker holds now, until ``done()`` or nothing more is there.

        Raises :class:`LedgerError` when that takes longer than ``timeout_s`` (the broker is
        unreachable or keeps stalling).
        """
        deadline = self._loop.time() + timeout_s
        stall_s = self._store.config.reader_stall_s
        while True:
            self._check_usable()
            if not await self._keep_going():
                if self._loop.time() >= deadline:
                    raise LedgerError(
                        f"reader of ledger {self._ledger_id}: cannot re-create it in "
                        f"{timeout_s:g} s (is the Pulsar broker reachable?)"
                    )
                continue
            if done():
                return
            if self._thread.paused:
                return  # the buffer is full: the caller has entries to consume first
            more = await self._probe()
            self._check_usable()
            if done() or more is False:
                return
            if more is True and self._thread.progressed_since_probe():
                continue  # what the broker had arrived with the answer: ask again
            if self._loop.time() >= deadline:
                raise LedgerError(
                    f"reader of ledger {self._ledger_id}: no progress in {timeout_s:g} s "
                    "(is the Pulsar broker reachable?)"
                )
            delivered = await self._wait_delivery(min(stall_s, deadline - self._loop.time()))
            if not delivered and self._stalled(more):
                self._pump_error = _RestartReader("stalled: nothing arrives")

    async def read(self, first_entry_id: int, max_entries: int) -> list[LedgerEntry]:
        if first_entry_id < 0 or max_entries < 0:
            raise ValueError(f"bad range: first={first_entry_id} max={max_entries}")
        self._check_usable()
        if max_entries == 0:
            return []
        if first_entry_id < self._buf.base_id:
            await self._rewind()
        self._trim(first_entry_id)
        wanted_end = first_entry_id + max_entries
        await self.settle(
            lambda: self._buf.end() >= wanted_end or self._buf.seal_last is not None,
            self._store.config.operation_timeout_s,
        )
        self._check_usable()
        end = min(self._buf.end(), wanted_end)
        if first_entry_id >= end:
            return []
        return self._buf.get(first_entry_id, end)

    async def wait_for_entries(self, after_entry_id: int, timeout_s: float) -> bool:
        deadline = self._loop.time() + max(0.0, timeout_s)
        stall_s = self._store.config.reader_stall_s
        self._trim(after_entry_id + 1)
        while True:
            self._check_usable()
            if not await self._keep_going() and self._loop.time() >= deadline:
                return False  # cannot tell now (the broker is unreachable)
            if self._buf.end() > after_entry_id + 1:
                return True
            if self._buf.seal_last is not None:
                return False
            remaining_s = deadline - self._loop.time()
            if remaining_s <= 0:
                # "May be readable" must include what the broker held when we were called.
                await self.settle(
                    lambda: self._buf.end() > after_entry_id + 1 or self._buf.seal_last is not None,
                    self._store.config.operation_timeout_s,
                )
                self._check_usable()
                return self._buf.end() > after_entry_id + 1
            delivered = await self._wait_delivery(min(remaining_s, stall_s))
            if not delivered and remaining_s > stall_s:
                more = await self._probe()
                progressed = more is True and self._thread.progressed_since_probe()
                if not progressed and self._stalled(more):
                    self._pump_error = _RestartReader("stalled: nothing arrives")

    def _trim(self, keep_from_id: int) -> None:
        """Forget entries before ``keep_from_id`` once the buffer is over its budget."""
        self._buf.trim(keep_from_id, READER_BUFFER_BYTES)
        if self._buf.buffered_bytes <= READER_BUFFER_BYTES and self._thread.paused:
            self._thread.resume()

    async def _rewind(self) -> None:
        """Read from the start again (a read before what the buffer still holds)."""
        self._buf.rewind()
        self._retried_at = None
        self._thread.resume()
        await self._recreate("rewound for an entry no longer buffered")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.close()
        self._wake()
        reader, self._reader = self._reader, None
        if reader is not None:
            # Interrupts the thread's read_next (AlreadyClosed), which ends it.
            await self._store.close_quietly(reader, f"reader of ledger {self._ledger_id}")
        self._store.forget(self)


class _RestartReader(Exception):
    """The reader must start over after its last accepted message (a gap, a stall)."""
