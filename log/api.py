"""The ledger interface (docs/DESIGN.md §3), implemented by every backend.

BookKeeper's model: a *ledger* is an append-only sequence of entries ``0..n``
written by exactly one writer. A reader may tail a ledger that is still being
written, or open it with ``recovery=True``, which fences the writer (its later
appends fail with :class:`LedgerFencedError`) and fixes the ledger's final
length.

Every stored entry carries the writer's *last add confirmed* (LAC) at the time
it was written: the highest entry id that was durable (and acknowledged) when
this entry was handed to storage. A tailing reader must only hand entry ``k``
to its consumer once it has seen ``LAC >= k`` or the ledger was closed past
``k``; backends expose both so the replication layer can enforce it.

The *ledger list* (which ledgers make up the system's history) is kept by a
:class:`LedgerListStore` and only changed with compare-and-set.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class LedgerError(Exception):
    """Base class of every ledger failure."""


class LedgerFencedError(LedgerError):
    """The ledger was opened with recovery by someone else: this writer is deposed."""


class LedgerClosedError(LedgerError):
    """Append to a writer that was closed."""


class NoSuchLedgerError(LedgerError):
    """The ledger id is unknown to the store (never created, or deleted)."""


class BadVersionError(LedgerError):
    """Compare-and-set on the ledger list failed: somebody else changed it."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    ledger_id: int
    entry_id: int
    # The writer's last add confirmed when this entry was written (-1: none yet).
    last_add_confirmed: int
    data: bytes


# A failed writer's error type and reason, raised by every later append.
_Failure = tuple[type[LedgerError], str]


class LedgerWriter(ABC):
    """The one writer of one ledger. Appends complete in call order."""

    # Set once the owner confirms entries itself (see confirm()).
    _confirmed_by_owner: int | None = None

    def confirm(self, entry_id: int) -> None:
        """The owner vouches for the entries up to ``entry_id``.

        From the first call on, appends carry ``min(durable, confirmed)`` as their
        last-add-confirmed instead of the durable horizon alone. A replicated log calls it
        after its own leadership check (docs/DESIGN.md §4): with a backend that cannot fence, a
        deposed writer's late appends then never confirm an entry that is not part of
        the history the next leader recovered. ``confirm(-1)`` only switches this on.
        """
        if self._confirmed_by_owner is None or entry_id > self._confirmed_by_owner:
            self._confirmed_by_owner = entry_id

    def lac_to_stamp(self, durable: int) -> int:
        """The last-add-confirmed to write into the next entries (for backends)."""
        owner = self._confirmed_by_owner
        return durable if owner is None else min(durable, owner)

    # Every backend keeps these three; set in its __init__.
    _ledger_id: int
    _last_add_confirmed: int = -1
    _size_bytes: int = 0
    _closed: bool = False

    def _refuse_append(self, future: asyncio.Future[int], failure: _Failure | None) -> bool:
        """Fail ``future`` if the writer failed (``failure``) or is closed; True if it did."""
        if failure is not None:
            error_type, reason = failure
            future.set_exception(error_type(reason))
            return True
        if self._closed:
            future.set_exception(LedgerClosedError(f"writer of ledger {self._ledger_id} is closed"))
            return True
        return False

    @property
    def ledger_id(self) -> int:
        return self._ledger_id

    @property
    def last_add_confirmed(self) -> int:
        """Highest entry id known durable; -1 when none."""
        return self._last_add_confirmed

    @property
    def size_bytes(self) -> int:
        """Bytes appended so far (for rolling ledgers by size)."""
        return self._size_bytes

    @abstractmethod
    def append(self, data: bytes) -> asyncio.Future[int]:
        """Queue ``data``; the future resolves to its entry id once durable.

        Must be called from the event loop thread. Ids are assigned in call
        order; futures resolve in id order. Concurrent appends share one
        flush (group commit). On fencing every pending and later append fails
        with :class:`LedgerFencedError`; on an IO error with :class:`LedgerError`.
        """

    @abstractmethod
    async def close(self) -> int:
        """Wait for pending appends, then close. Returns the last entry id (-1: empty)."""


class LedgerReader(ABC):
    """Reads one ledger, possibly while its writer is still appending."""

    # Every backend keeps these two; set in its __init__.
    _ledger_id: int
    _last_entry_id: int | None = None

    @property
    def ledger_id(self) -> int:
        return self._ledger_id

    @property
    def last_entry_id(self) -> int | None:
        """After ``recovery=True``: the final last entry id (-1 when empty). Else None."""
        return self._last_entry_id

    @abstractmethod
    async def read(self, first_entry_id: int, max_entries: int) -> list[LedgerEntry]:
        """Entries from ``first_entry_id`` on, in order, at most ``max_entries``.

        Returns what is stored now (possibly an empty list); never blocks waiting
        for new entries and never returns an entry past a recovered length.
        """

    @abstractmethod
    async def wait_for_entries(self, after_entry_id: int, timeout_s: float) -> bool:
        """Wait until an entry with id > ``after_entry_id`` may be readable (or timeout)."""

    @abstractmethod
    async def close(self) -> None: ...


class LedgerStore(ABC):
    """A backend: memory, file (one host) or pulsar.

    Keeps track of its open writers and readers so ``close()`` closes them all.
    """

    #: Whether ``open(recovery=True)`` makes the old writer's appends fail.
    can_fence: bool = True

    def __init__(self) -> None:
        self._writers: set[LedgerWriter] = set()
        self._readers: set[LedgerReader] = set()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerClosedError("ledger store is closed")

    def forget(self, handle: LedgerWriter | LedgerReader) -> None:
        """Called by a writer or reader when it is closed."""
        if isinstance(handle, LedgerWriter):
            self._writers.discard(handle)
        else:
            self._readers.discard(handle)

    async def close(self) -> None:
        """Close every open writer (draining it), then every reader."""
        if self._closed:
            return
        for writer in list(self._writers):
            await writer.close()
        for reader in list(self._readers):
            await reader.close()
        self._closed = True

    @abstractmethod
    async def create_ledger(self) -> LedgerWriter:
        """Create a ledger with a new id (greater than every id this store handed out)."""

    @abstractmethod
    async def open_ledger(self, ledger_id: int, *, recovery: bool) -> LedgerReader:
        """Open for reading. ``recovery=True`` fences the writer and fixes the length."""

    @abstractmethod
    async def delete_ledger(self, ledger_id: int) -> None:
        """Delete; deleting an unknown id is not an error (idempotent)."""

    @abstractmethod
    async def list_ledgers(self) -> list[int]:
        """Ids of the ledgers this store holds (for retention and diagnostics)."""


class LedgerState(StrEnum):
    OPEN = "open"
    CLOSING = "closing"  # being recovered by a new leader
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class LedgerInfo:
    ledger_id: int
    created_ms: int
    state: LedgerState
    # Last entry id when closed (-1: empty ledger); None while open or closing.
    last_entry_id: int | None = None


@dataclass(frozen=True, slots=True)
class LedgerList:
    """The system's history: ledgers in order, oldest first."""

    ledgers: tuple[LedgerInfo, ...] = ()
    # The very first ledger of the system's history (kept when older ledgers are
    # deleted by retention, so a broker can tell its snapshot is too old).
    first_ledger_id: int | None = None
    # Free-form owner of the list (the leader's broker id), for diagnostics.
    writer: str = ""
    extra: dict[str, str] = field(default_factory=dict)


class LedgerListStore(ABC):
    """Holds the ledger list; changed only by compare-and-set on a version."""

    @abstractmethod
    async def get(self) -> tuple[LedgerList, int]:
        """The current list and its version (-1 when it was never written)."""

    @abstractmethod
    async def compare_and_set(self, new: LedgerList, expected_version: int) -> int:
        """Replace if the version still is ``expected_version``; returns the new version.

        Raises :class:`BadVersionError` otherwise. ``expected_version=-1`` creates it.
        """

    async def confirmed_version(self) -> int:
        """The list's version as of now, linearizably: ``sync`` then read the version.

        The leader's check after each group commit; a replicated store may pipeline the
        two requests into one round trip.
        """
        await self.sync()
        _, version = await self.get()
        return version

    async def sync(self) -> None:  # noqa: B027 - a no-op for stores without replicas
        """Make the next ``get`` see every change committed before this call.

        A no-op for local stores; ZooKeeper's ``sync`` for the replicated one (the
        leader's check that it is still the leader after each group commit).
        """


def ledger_ids(ledger_list: LedgerList) -> Sequence[int]:
    return [info.ledger_id for info in ledger_list.ledgers]
