"""The reader (tailer) of one ledger's topic, through the client's Reader API (package
docstring)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pulsar  # type: ignore[import-untyped]

from log.api import (
    LedgerClosedError,
    LedgerEntry,
    LedgerError,
    LedgerReader,
    NoSuchLedgerError,
)
from log.pulsar.client import _ThreadInbox, logger
from log.pulsar.entry_buffer import EntryBuffer

if TYPE_CHECKING:
    from log.pulsar.store import PulsarLedgerStore


#: A reader stops fetching while it holds more than this many bytes nobody read yet.
READER_BUFFER_BYTES = 32 * 1024 * 1024
#: How long the reader thread blocks in one ``read_next``: the latency of a "has the broker
#: more?" check (done on that thread between reads, so it never races a delivery).
_POLL_MS = 10
#: Pause between attempts to re-create a reader while the broker is unreachable.
_RETRY_PAUSE_S = 0.2


_Probe = asyncio.Future[bool | None]


class PulsarLedgerReader(LedgerReader):
    """Reads one ledger's topic through the Reader API; see the :mod:`log.pulsar` docstring.

    One thread per reader blocks in ``read_next`` and posts what it receives to the loop
    (the client's Reader has no callback API, and an abandoned async receive would lose its
    message). The same thread answers "has the broker more?" checks between two reads, so an
    answer of "no" comes after every message received before it was posted.
    """

    def __init__(self, store: PulsarLedgerStore, ledger_id: int) -> None:
        self._store = store
        self._ledger_id = ledger_id
        self._topic = store.config.topic(ledger_id)
        self._loop = asyncio.get_running_loop()
        self._reader: Any = None
        # Bumped on every re-creation: what an older reader thread posts is ignored.
        self._generation = 0
        self._buf = EntryBuffer(ledger_id)  # what was received, decoded
        self._last_entry_id: int | None = None
        self._last_received_id: Any = None  # of the current generation, for ordering checks
        self._retried_at: int | None = None  # next id for which a gap already caused a restart
        self._pump_error: BaseException | None = None
        # Messages of the current reader handled, and how many when the last probe answered:
        # more since then means the broker's "more" already arrived (no stall).
        self._handled_count = 0
        self._handled_at_probe = 0
        self._waiters: set[asyncio.Future[None]] = set()
        self._probes: list[_Probe] = []  # loop-side, guarded by _probe_lock
        self._probe_lock = threading.Lock()
        self._pump_wake = threading.Event()
        self._paused = False
        self._recreate_lock = asyncio.Lock()
        self._inbox = _ThreadInbox(self._loop, self._on_items)
        self._closed = False
        #: How often this reader was re-created (stalls, gaps), for diagnostics and tests.
        self.recreations = 0

    @property
    def ledger_id(self) -> int:
        return self._ledger_id

    @property
    def last_entry_id(self) -> int | None:
        return self._last_entry_id

    @property
    def sealed_last_entry_id(self) -> int | None:
        """The last entry id once this reader has seen the ledger's SEAL, else None."""
        return self._buf.seal_last

    # -- the reader thread --------------------------------------------------------------------

    def _pump(self, reader: Any, generation: int) -> None:
        post = self._inbox.post
        while generation == self._generation:
            with self._probe_lock:
                probes, self._probes = self._probes, []
            if probes:
                answer: bool | None
                try:
                    answer = bool(reader.has_message_available())
                except Exception as exc:
                    logger.debug("ledger %d: has_message_available: %s", self._ledger_id, exc)
                    answer = None
                post(("probe", generation, probes, answer))
            if self._paused:
                self._pump_wake.wait(0.1)
                self._pump_wake.clear()
                continue
            try:
                message = reader.read_next(_POLL_MS)
            except pulsar.Timeout:
                continue
            except Exception as exc:
                post(("error", generation, exc, None))
                return
            post(("message", generation, message.data(), message.message_id()))

    # -- on the loop ---------------------------------------------------------------------------

    def _on_items(self, items: list[tuple[str, int, Any, Any]]) -> None:
        for kind, generation, first, second in items:
            if kind == "probe":
                current = generation == self._generation and not self._closed
                self._handled_at_probe = self._handled_count
                for probe in first:
                    if not probe.done():
                        probe.set_result(second if current else None)
            elif generation != self._generation or self._closed:
                continue
            elif kind == "error":
                self._pump_error = first
                self._answer_probes(None)
            else:
                self._handled_count += 1
                self._accept(first, second)
        if self._buf.buffered_bytes > READER_BUFFER_BYTES:
            self._paused = True
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
        self._generation += 1
        self._pump_error = _RestartReader(what)
        self._answer_probes(None)
        self._wake()
        return True

    def _answer_probes(self, answer: bool | None) -> None:
        """Answer the waiting probes now (their reader thread is gone or going)."""
        with self._probe_lock:
            probes, self._probes = self._probes, []
        for probe in probes:
            if not probe.done():
                probe.set_result(answer)

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
        probe: _Probe = self._loop.create_future()
        with self._probe_lock:
            self._probes.append(probe)
        self._pump_wake.set()
        try:
            async with asyncio.timeout(self._store.config.operation_timeout_s):
                return await probe
        except TimeoutError:
            return None

    async def start(self) -> None:
        await self._recreate("opened")

    async def _recreate(self, reason: str) -> None:
        """A new Reader from the last accepted message on (the broken one is closed)."""
        async with self._recreate_lock:
            self._check_usable()
            old = self._reader
            self._generation += 1
            generation = self._generation
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
            if self._closed or generation != self._generation:
                await self._store.close_quietly(reader, f"reader of ledger {self._ledger_id}")
                return
            self._reader = reader
            thread = threading.Thread(
                target=self._pump,
                args=(reader, generation),
                name=f"ledger-{self._ledger_id}-reader",
                daemon=True,
            )
            thread.start()

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
        if self._pump_error is not None or self._paused:
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
            if self._paused:
                return  # the buffer is full: the caller has entries to consume first
            more = await self._probe()
            self._check_usable()
            if done() or more is False:
                return
            if more is True and self._handled_count > self._handled_at_probe:
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
                progressed = more is True and self._handled_count > self._handled_at_probe
                if not progressed and self._stalled(more):
                    self._pump_error = _RestartReader("stalled: nothing arrives")

    def _trim(self, keep_from_id: int) -> None:
        """Forget entries before ``keep_from_id`` once the buffer is over its budget."""
        self._buf.trim(keep_from_id, READER_BUFFER_BYTES)
        if self._buf.buffered_bytes <= READER_BUFFER_BYTES and self._paused:
            self._paused = False
            self._pump_wake.set()

    async def _rewind(self) -> None:
        """Read from the start again (a read before what the buffer still holds)."""
        self._buf.rewind()
        self._retried_at = None
        self._paused = False
        self._pump_wake.set()
        await self._recreate("rewound for an entry no longer buffered")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._generation += 1
        self._pump_wake.set()
        self._answer_probes(None)
        self._wake()
        reader, self._reader = self._reader, None
        if reader is not None:
            # Interrupts the thread's read_next (AlreadyClosed), which ends it.
            await self._store.close_quietly(reader, f"reader of ledger {self._ledger_id}")
        self._store.forget(self)


class _RestartReader(Exception):
    """The reader must start over after its last accepted message (a gap, a stall)."""
