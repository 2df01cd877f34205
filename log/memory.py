"""In-process ledger backend (docs/DESIGN.md §3) for unit tests and simulations.

Several :class:`MemoryLedgerStore` instances may share one :class:`MemoryLedgerCluster`,
the way several brokers share one BookKeeper cluster; a test "restarts" a store by
closing it and opening a new one on the same cluster.

An append becomes durable on the next event-loop iteration, together with every other
append queued in the same iteration (a stand-in for group commit), so pending appends
exist and fencing can catch them.

With ``MemoryLedgerCluster(sync_delay_s=...)`` a flushed batch is readable at once but
durable (its futures resolved, counted in the LAC) only that much later, like a write in
the page cache before its fsync: tailing readers then see unconfirmed entries, and
:meth:`MemoryLedgerStore.crash` (a kill -9 of the store's process) loses them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from log.api import (
    BadVersionError,
    LedgerClosedError,
    LedgerEntry,
    LedgerError,
    LedgerFencedError,
    LedgerList,
    LedgerListStore,
    LedgerReader,
    LedgerStore,
    LedgerWriter,
    NoSuchLedgerError,
)

logger = logging.getLogger(__name__)


class _MemoryLedger:
    """One ledger's stored entries and fencing state, shared by every store of a cluster."""

    def __init__(self, ledger_id: int) -> None:
        self.ledger_id = ledger_id
        self.entries: list[LedgerEntry] = []
        # Set by recovery; no entry past it is ever stored.
        self.fenced_last_entry_id: int | None = None
        self.deleted = False
        self.writer: MemoryLedgerWriter | None = None
        # A dict, not a set: waking in a fixed order keeps seeded simulations reproducible.
        self._waiters: dict[asyncio.Future[None], None] = {}

    def wake_waiters(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait_for_change(self, timeout_s: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[waiter] = None
        try:
            # asyncio.wait, unlike wait_for, never raises on timeout.
            await asyncio.wait({waiter}, timeout=timeout_s)
        finally:
            self._waiters.pop(waiter, None)


class MemoryLedgerCluster:
    """The storage shared by the :class:`MemoryLedgerStore` instances built on it."""

    def __init__(self, *, sync_delay_s: float = 0.0) -> None:
        self.ledgers: dict[int, _MemoryLedger] = {}
        # Ids start at 1 like the file backend, so 0 never looks like a real ledger.
        self.next_ledger_id = 1
        # > 0: written batches are readable before they are durable (see the module doc).
        self.sync_delay_s = sync_delay_s


class MemoryLedgerWriter(LedgerWriter):
    def __init__(self, store: MemoryLedgerStore, ledger: _MemoryLedger) -> None:
        self._store = store
        self._ledger = ledger
        self._ledger_id = ledger.ledger_id
        self._next_entry_id = 0
        self._last_add_confirmed = -1
        self._size_bytes = 0
        self._pending: list[tuple[int, bytes, asyncio.Future[int]]] = []
        self._flush_handle: asyncio.Handle | None = None
        # Stored (readable) but not yet durable: only with a cluster sync delay.
        self._unsynced: list[tuple[int, asyncio.Future[int]]] = []
        self._sync_handle: asyncio.TimerHandle | None = None
        self._closed = False
        self._fenced = False

    def append(self, data: bytes) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        refusal = self._refusal()
        if refusal is not None:
            future.set_exception(refusal)
            return future
        entry_id = self._next_entry_id
        self._next_entry_id += 1
        self._size_bytes += len(data)
        self._pending.append((entry_id, bytes(data), future))
        if self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        return future

    def _refusal(self) -> LedgerError | None:
        if self._ledger.deleted:
            return NoSuchLedgerError(f"ledger {self.ledger_id} was deleted")
        if self._fenced:
            return LedgerFencedError(f"ledger {self.ledger_id} was fenced by recovery")
        if self._closed:
            return LedgerClosedError(f"writer of ledger {self.ledger_id} is closed")
        return None

    def _flush(self) -> None:
        self._flush_handle = None
        batch, self._pending = self._pending, []
        if not batch:
            return
        # Like the file backend: the LAC stamped is what was durable when the batch started.
        lac = self.lac_to_stamp(self._last_add_confirmed)
        for entry_id, data, _ in batch:
            self._ledger.entries.append(LedgerEntry(self.ledger_id, entry_id, lac, data))
        written = [(entry_id, future) for entry_id, _, future in batch]
        delay_s = self._store.cluster.sync_delay_s
        if delay_s > 0:
            self._unsynced += written
            if self._sync_handle is None:
                self._sync_handle = asyncio.get_running_loop().call_later(delay_s, self._sync)
        else:
            self._confirm(written)
        self._ledger.wake_waiters()

    def _sync(self) -> None:
        # Like an fsync, covers every batch written before it runs.
        self._sync_handle = None
        batch, self._unsynced = self._unsynced, []
        if batch:
            self._confirm(batch)

    def _confirm(self, batch: list[tuple[int, asyncio.Future[int]]]) -> None:
        self._last_add_confirmed = batch[-1][0]
        for entry_id, future in batch:
            # A cancelled future's entry is stored anyway, as it would be on disk.
            if not future.done():
                future.set_result(entry_id)

    def _fail_pending(self, error_type: type[LedgerError], reason: str) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        batch, self._pending = self._pending, []
        for _, _, future in batch:
            if not future.done():
                # One instance per future: re-raising a shared exception grows its traceback.
                future.set_exception(error_type(reason))

    def fence(self) -> None:
        self._fenced = True
        self._fail_pending(LedgerFencedError, f"ledger {self.ledger_id} was fenced by recovery")

    def on_deleted(self) -> None:
        self._fail_pending(NoSuchLedgerError, f"ledger {self.ledger_id} was deleted")

    def crash(self) -> None:
        """The writer's process died: queued and unsynced appends are lost (those a
        recovery already fenced into the ledger stay), every later append fails."""
        self._closed = True
        lost = [future for _, _, future in self._pending]
        self._fail_pending(LedgerClosedError, "the writer's process died")
        if self._sync_handle is not None:
            self._sync_handle.cancel()
            self._sync_handle = None
        unsynced, self._unsynced = self._unsynced, []
        if unsynced:
            keep = unsynced[0][0]
            fenced_last = self._ledger.fenced_last_entry_id
            if fenced_last is not None:
                keep = max(keep, fenced_last + 1)
            del self._ledger.entries[keep:]
        for _, future in unsynced:
            lost.append(future)
            if not future.done():
                future.set_exception(LedgerClosedError("the writer's process died"))
        for future in lost:
            if not future.cancelled():
                future.exception()  # nobody is left to read it: keep asyncio quiet
        self._store.forget(self)

    async def close(self) -> int:
        self._closed = True
        pending = {future for _, _, future in self._pending}
        pending.update(future for _, future in self._unsynced)
        if pending:
            # asyncio.wait does not cancel the appends if close() itself is cancelled.
            await asyncio.wait(pending)
        self._store.forget(self)
        return self._last_add_confirmed


class MemoryLedgerReader(LedgerReader):
    def __init__(
        self, store: MemoryLedgerStore, ledger: _MemoryLedger, last_entry_id: int | None
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._ledger_id = ledger.ledger_id
        self._last_entry_id = last_entry_id
        self._closed = False

    def _check_readable(self) -> None:
        if self._closed:
            raise LedgerClosedError(f"reader of ledger {self.ledger_id} is closed")
        if self._ledger.deleted:
            raise NoSuchLedgerError(f"ledger {self.ledger_id} was deleted")

    def _stored_count(self) -> int:
        count = len(self._ledger.entries)
        fenced_last = self._ledger.fenced_last_entry_id
        return count if fenced_last is None else min(count, fenced_last + 1)

    async def read(self, first_entry_id: int, max_entries: int) -> list[LedgerEntry]:
        if first_entry_id < 0 or max_entries < 0:
            raise ValueError(f"bad range: first={first_entry_id} max={max_entries}")
        self._check_readable()
        end = min(first_entry_id + max_entries, self._stored_count())
        return self._ledger.entries[first_entry_id:end]

    async def wait_for_entries(self, after_entry_id: int, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while True:
            self._check_readable()
            if self._stored_count() > after_entry_id + 1:
                return True
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                return False
            await self._ledger.wait_for_change(remaining_s)

    async def close(self) -> None:
        self._closed = True
        self._store.forget(self)


class MemoryLedgerStore(LedgerStore):
    can_fence = True

    def __init__(self, cluster: MemoryLedgerCluster | None = None) -> None:
        super().__init__()
        self.cluster = cluster if cluster is not None else MemoryLedgerCluster()

    def _get(self, ledger_id: int) -> _MemoryLedger:
        ledger = self.cluster.ledgers.get(ledger_id)
        if ledger is None:
            raise NoSuchLedgerError(f"no ledger {ledger_id}")
        return ledger

    async def create_ledger(self) -> LedgerWriter:
        self._check_open()
        ledger = _MemoryLedger(self.cluster.next_ledger_id)
        self.cluster.next_ledger_id += 1
        self.cluster.ledgers[ledger.ledger_id] = ledger
        writer = MemoryLedgerWriter(self, ledger)
        ledger.writer = writer
        self._writers.add(writer)
        return writer

    async def open_ledger(self, ledger_id: int, *, recovery: bool) -> LedgerReader:
        self._check_open()
        ledger = self._get(ledger_id)
        last_entry_id: int | None = None
        if recovery:
            if ledger.fenced_last_entry_id is None:
                if ledger.writer is not None:
                    ledger.writer.fence()
                ledger.fenced_last_entry_id = len(ledger.entries) - 1
                logger.info("ledger %d fenced at entry %d", ledger_id, ledger.fenced_last_entry_id)
                ledger.wake_waiters()
            last_entry_id = ledger.fenced_last_entry_id
        reader = MemoryLedgerReader(self, ledger, last_entry_id)
        self._readers.add(reader)
        return reader

    async def delete_ledger(self, ledger_id: int) -> None:
        self._check_open()
        ledger = self.cluster.ledgers.pop(ledger_id, None)
        if ledger is None:
            return
        ledger.deleted = True
        if ledger.writer is not None:
            ledger.writer.on_deleted()
        ledger.wake_waiters()

    async def list_ledgers(self) -> list[int]:
        self._check_open()
        return sorted(self.cluster.ledgers)

    def crash(self) -> None:
        """Simulate this store's process being killed (kill -9), no cleanup: its writers
        lose what is not durable yet (see :meth:`MemoryLedgerWriter.crash`); the store
        refuses every later call. The ledgers stay in the cluster for the other stores."""
        for writer in list(self._writers):
            assert isinstance(writer, MemoryLedgerWriter)
            writer.crash()
        self._closed = True


def _copy_list(ledger_list: LedgerList) -> LedgerList:
    # LedgerList is frozen but its ``extra`` dict is not: keep callers from editing the stored one.
    return dataclasses.replace(ledger_list, extra=dict(ledger_list.extra))


class MemoryLedgerListStore(LedgerListStore):
    """The ledger list in memory; share one instance between the stores that should see it."""

    def __init__(self) -> None:
        self._ledger_list = LedgerList()
        self._version = -1

    async def get(self) -> tuple[LedgerList, int]:
        return _copy_list(self._ledger_list), self._version

    async def compare_and_set(self, new: LedgerList, expected_version: int) -> int:
        if expected_version != self._version:
            raise BadVersionError(
                f"ledger list is at version {self._version}, expected {expected_version}"
            )
        self._ledger_list = _copy_list(new)
        self._version += 1
        return self._version
