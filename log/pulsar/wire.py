"""The message format of a ledger's topic: the header, the kinds of message, entry framing
(see the :mod:`log.pulsar` package docstring)."""

from __future__ import annotations

import struct
from enum import IntEnum

#: Message header: magic, kind, entry id (the first one for ENTRIES, the ledger id for
#: CREATED), last add confirmed.
HEADER = struct.Struct(">BBqq")
#: In an ENTRIES message, each entry is its length then its bytes.
ENTRY_LENGTH = struct.Struct(">I")
MAGIC = 0xE5
#: Pulsar's default ``maxMessageSize`` is 5 MiB (pulsar-lite's too); the rest is headroom for
#: the header and the message metadata. Larger appends raise ValueError.
MAX_ENTRY_SIZE_BYTES = 5 * 1024 * 1024 - 64 * 1024


class Kind(IntEnum):
    ENTRIES = 1
    CREATED = 2
    SEAL = 3
    DELETED = 4


def encode_message(kind: Kind, entry_id: int, last_add_confirmed: int) -> bytes:
    """A marker message (CREATED, SEAL, DELETED) as stored in a ledger's topic."""
    return HEADER.pack(MAGIC, kind, entry_id, last_add_confirmed)


def encode_entries(first_entry_id: int, last_add_confirmed: int, entries: list[bytes]) -> bytes:
    """An ENTRIES message: consecutive entries from ``first_entry_id``, one LAC for all."""
    parts = [HEADER.pack(MAGIC, Kind.ENTRIES, first_entry_id, last_add_confirmed)]
    for data in entries:
        parts.append(ENTRY_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_entries(payload: bytes) -> list[bytes] | None:
    """The entries of an ENTRIES message (after the header); None when the framing is bad."""
    entries: list[bytes] = []
    view = memoryview(payload)
    pos = HEADER.size
    length_size = ENTRY_LENGTH.size
    while pos < len(payload):
        if pos + length_size > len(payload):
            return None
        (length,) = ENTRY_LENGTH.unpack_from(payload, pos)
        pos += length_size
        if pos + length > len(payload):
            return None
        entries.append(bytes(view[pos : pos + length]))
        pos += length
    return entries if entries else None
