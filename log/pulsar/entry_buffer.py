"""What a ledger reader has received, decoded: the entries in order, the ledger's markers
(CREATED, SEAL, DELETED) and where a re-created reader starts (package docstring)."""

from __future__ import annotations

from typing import Any

from log.api import LedgerEntry
from log.pulsar.client import logger
from log.pulsar.wire import HEADER, MAGIC, Kind, decode_entries


class EntryBuffer:
    """The decoded messages of one ledger's topic, from the loop.

    ``entries`` holds ids ``base_id`` .. ``next_id - 1`` (older ones are dropped by
    :meth:`trim` once over the reader's budget); ``corrupt`` says why the topic cannot be
    read, once it cannot.
    """

    def __init__(self, ledger_id: int) -> None:
        self.ledger_id = ledger_id
        self.entries: list[LedgerEntry] = []
        self.base_id = 0  # entry id of entries[0]
        self.buffered_bytes = 0
        self.next_id = 0
        self.created = False
        self.seal_last: int | None = None  # the first SEAL: last entry id of the ledger
        self.deleted = False
        self.corrupt: str | None = None
        # Where a re-created reader starts (inclusive): the last message accepted.
        self.last_message_id: Any = None

    def accept(self, data: bytes, message_id: Any) -> str | None:
        """Take in one message; a gap before it is returned (the reader must start over
        after the last accepted message), else None."""
        if len(data) < HEADER.size:
            self.corrupt = f"a message of {len(data)} bytes (shorter than the header)"
            return None
        magic, kind, entry_id, lac = HEADER.unpack_from(data)
        if magic != MAGIC:
            self.corrupt = f"a message with magic {magic:#x}, not written by Steward"
            return None
        if kind == Kind.ENTRIES:
            if self.deleted or (self.seal_last is not None and entry_id > self.seal_last):
                return None  # past the end: a deposed writer's late append
            payloads = decode_entries(data)
            if payloads is None:
                self.corrupt = f"a message of entries from {entry_id} with broken framing"
                return None
            if entry_id > self.next_id:
                return f"entry {entry_id} while expecting {self.next_id}"
            # Entries below the next id are duplicates (a producer resend, a redelivery).
            for offset in range(self.next_id - entry_id, len(payloads)):
                payload = payloads[offset]
                self.entries.append(LedgerEntry(self.ledger_id, entry_id + offset, lac, payload))
                self.buffered_bytes += len(payload)
                self.next_id += 1
                self.last_message_id = message_id
        elif kind == Kind.CREATED:
            if entry_id != self.ledger_id:
                self.corrupt = f"the CREATED marker of ledger {entry_id}"
            elif not self.created:
                self.created = True
                self.last_message_id = message_id
        elif kind == Kind.SEAL:
            if self.seal_last is None:
                self.seal_last = self.next_id - 1
                self.last_message_id = message_id
        elif kind == Kind.DELETED:
            self.deleted = True
        else:
            logger.warning("ledger %d: ignoring a message of unknown kind %d", self.ledger_id, kind)
        return None

    def end(self) -> int:
        """One past the last entry a read may return now."""
        if self.seal_last is not None:
            return min(self.next_id, self.seal_last + 1)
        return self.next_id

    def get(self, first_entry_id: int, end: int) -> list[LedgerEntry]:
        """Entries ``first_entry_id`` .. ``end - 1`` (all still buffered)."""
        return self.entries[first_entry_id - self.base_id : end - self.base_id]

    def trim(self, keep_from_id: int, budget_bytes: int) -> None:
        """Forget entries before ``keep_from_id`` once the buffer is over ``budget_bytes``."""
        if self.buffered_bytes <= budget_bytes:
            return
        drop = min(max(0, keep_from_id - self.base_id), len(self.entries))
        self.buffered_bytes -= sum(len(entry.data) for entry in self.entries[:drop])
        del self.entries[:drop]
        self.base_id += drop

    def rewind(self) -> None:
        """Forget every entry: the reader reads from the start again."""
        self.entries = []
        self.base_id = self.next_id = 0
        self.buffered_bytes = 0
        self.last_message_id = None
