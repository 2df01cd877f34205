"""The ``pulsar`` ledger backend (DESIGN §3): one persistent Pulsar topic per ledger.

Brokers on several hosts share no disk, only ZooKeeper and the Pulsar cluster (Apache Pulsar
>= 2.11, or pulsar-lite for tests and the local dev cluster), as Majordodo does with
BookKeeper.

Topics and messages
-------------------
Ledger ``N`` is the topic ``persistent://<tenant>/<namespace>/<cluster>-ledger-<N:012d>``.
Ids come from an allocator shared by every broker (``ledger_ids``; in a cluster the
:class:`log.zk_list.ZooKeeperLedgerIdAllocator`) and must never repeat.

Every message payload starts with a small binary header, ``HEADER`` (big-endian
``[u8 magic][u8 kind][i64 entry id][i64 last add confirmed]``). The header is in the payload
rather than in message properties because it travels with the entries whatever reads them
(one ``struct`` unpack, no string map per message), because one message carries several
entries (group commit, below), and so readers never depend on MessageId arithmetic to
number entries: the writer numbers them.

Kinds of messages, in a topic's order:

- ``CREATED`` (entry id field = the ledger id): written durably by ``create_ledger`` before
  the writer is handed out. Every ledger's topic is therefore non-empty, which lets a reader
  tell an existing ledger from an unknown one and makes ``has_message_available`` safe (it
  fails on an empty pulsar-lite topic).
- ``ENTRIES``: consecutive entries from the header's entry id on, each framed as
  ``[u32 length][bytes]``, all with the header's LAC.
- ``SEAL``: the end of the ledger, written by recovery (``open_ledger(recovery=True)``) and by
  a writer's clean ``close()``. **The first SEAL in the topic ends the ledger for every
  reader**: the ledger is the run of consecutive entry ids ``0..k`` before it. A writer that
  cannot be fenced (pulsar-lite) may append after a SEAL and even get those appends
  acknowledged, but no reader ever returns them, so the recovered length is the same for
  everyone, and recovery finds the end deterministically (it reads up to its own SEAL)
  instead of guessing it from a receive timeout.
- ``DELETED``: written by ``delete_ledger``; readers that reach it fail with
  :class:`~log.api.NoSuchLedgerError` (pulsar-lite cannot delete topics).

Readers accept an entry only when its id is exactly the next one expected: duplicates
(producer resends after a reconnect; pulsar-lite redeliveries) are dropped. An id past the
next one (a gap), or a MessageId that does not increase, makes the reader start over from
the last message it accepted, once per position; if the gap is still there, it is real (the
writer failed at that entry and never acknowledged anything after it) and the entries after
it are dropped. All readers apply the same rule to the same stored order, so they agree.

Writing
-------
Group commit, as in the file backend: ``append`` only queues; on the next event-loop
iteration everything queued goes out in as few messages as ``max_message_bytes`` allows
(while at most ``max_pending_sends`` messages are unacknowledged; more appends wait), so
Pulsar's per-message cost is shared and pulsar-lite's broken producer batching is not
needed. The producer itself is non-batched by default (``PulsarConfig.batching``) and sends
asynchronously; ``append`` returns a future resolved when the broker acknowledges the
message carrying the entry as durable, in call order, whatever order the client's
callbacks come in. The
client's callbacks run on its own threads; results are handed to the event loop with
``call_soon_threadsafe``. A failed send fails that append and every later one (the writer is
dead after that: :class:`~log.api.LedgerFencedError` for ``ProducerFenced``, else
:class:`~log.api.LedgerError`).

Fencing
-------
With ``PulsarConfig.fencing`` (real Pulsar >= 2.11) the writer's producer uses the
``ExclusiveWithFencing`` access mode, and recovery first takes the topic over with a
producer of the same mode, which fences the old writer (its sends fail with
``ProducerFenced``), then writes the SEAL and reads up to it. pulsar-lite ignores access
modes, so with it ``fencing`` must be False and ``can_fence`` is False: a deposed writer in
another process keeps getting acknowledgements, for entries no reader will ever return.
The replicated log does not rely on that: the leader confirms in ZooKeeper that it still
leads before it answers (DESIGN §4), and entries carry as LAC only what it confirmed
(``LedgerWriter.confirm``, see broker/replication/node.py). A writer of the same store is fenced
locally by recovery in any case.

Deletion and listing
--------------------
``delete_ledger`` writes the ``DELETED`` marker (when the ledger is known to exist), removes
the id from the catalog (below) and, with ``PulsarConfig.admin_url``, deletes the topic
through the admin REST API (``DELETE /admin/v2/persistent/{tenant}/{namespace}/{topic}``).
A failure there is logged and ignored: pulsar-lite has no admin API, so its topics stay on
disk (logically deleted by the marker) until the whole pulsar-lite data directory goes.

Which ledgers exist is answered by a *catalog*: the ``ledger_ids`` allocator when it also
has ``exists``, ``list_ids`` and ``remove`` (:class:`LedgerCatalog`; the ZooKeeper allocator
has them), for every broker and across restarts. Without one, ``list_ledgers`` knows the
ledgers this store created and did not delete, plus the topics the admin API lists, and an
unknown ledger is recognised by its topic having no ``CREATED`` message within
``PulsarConfig.open_wait_s``.

Namespace policy
----------------
The namespace must keep every message until Steward deletes the topic: **infinite retention**
(``retentionTimeInMinutes=-1``, ``retentionSizeInMB=-1``; readers hold no durable
subscription, so without retention acknowledged-by-nobody messages would be trimmed) and
**no inactive-topic deletion** (``deleteWhileInactive=false``; a closed ledger has no
producer and usually no reader for days). :meth:`PulsarLedgerStore.ensure_namespace_retention`
checks and applies both at start-up through the admin API:

    pulsar-admin namespaces set-retention TENANT/NAMESPACE --time -1 --size -1
    pulsar-admin namespaces set-inactive-topic-policies TENANT/NAMESPACE \\
        --disable-delete-while-inactive -t 1h -m delete_when_no_subscriptions

pulsar-lite
-----------
What pulsar-lite 0.2.0 gets wrong and how this module copes (INFRA.md): no producer access
modes (``fencing=False``); readers with ``receiver_queue_size`` > 1 or batched producers see
duplicates, out-of-order deliveries and stalls (``reader_queue_size=1``, ``batching=False``,
the reader's next-id rule, and a reader that starts over when it stalls); ``seek`` is broken
(never used: a reader is re-created from the last MessageId it accepted instead, inclusive,
because a reader started exclusive of a MessageId receives nothing from pulsar-lite);
``has_message_available`` raises on an empty topic, and on a reader started inclusive that
has received nothing yet the client seeks first, which hangs (so it is only asked once the
current reader received a message); no admin API (see above); each Reader leaves a
subscription behind (readers are re-created only on a stall, a gap or a rewind).
:meth:`PulsarConfig.for_pulsar_lite` and :meth:`PulsarConfig.for_apache_pulsar` give the
settings for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import struct
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Protocol, TypeVar, runtime_checkable

import httpx
import pulsar  # type: ignore[import-untyped]

from log.api import (
    LedgerClosedError,
    LedgerEntry,
    LedgerError,
    LedgerFencedError,
    LedgerReader,
    LedgerStore,
    LedgerWriter,
    NoSuchLedgerError,
)

logger = logging.getLogger(__name__)
#: The Pulsar C++ client logs through this logger. Left at NOTSET, it is set to WARNING:
#: at INFO the client logs every connection, producer and reader it creates.
CLIENT_LOGGER = logging.getLogger(__name__ + ".client")

#: Message header: magic, kind, entry id (the first one for ENTRIES, the ledger id for
#: CREATED), last add confirmed.
HEADER = struct.Struct(">BBqq")
#: In an ENTRIES message, each entry is its length then its bytes.
ENTRY_LENGTH = struct.Struct(">I")
MAGIC = 0xE5
#: Pulsar's default ``maxMessageSize`` is 5 MiB (pulsar-lite's too); the rest is headroom for
#: the header and the message metadata. Larger appends raise ValueError.
MAX_ENTRY_SIZE_BYTES = 5 * 1024 * 1024 - 64 * 1024
#: A reader stops fetching while it holds more than this many bytes nobody read yet.
READER_BUFFER_BYTES = 32 * 1024 * 1024
#: How long the reader thread blocks in one ``read_next``: the latency of a "has the broker
#: more?" check (done on that thread between reads, so it never races a delivery).
_POLL_MS = 10
#: Pause between attempts to re-create a reader while the broker is unreachable.
_RETRY_PAUSE_S = 0.2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMPRESSION = {
    "none": pulsar.CompressionType.NONE,
    "lz4": pulsar.CompressionType.LZ4,
    "zlib": pulsar.CompressionType.ZLib,
    "zstd": pulsar.CompressionType.ZSTD,
    "snappy": pulsar.CompressionType.SNAPPY,
}

_T = TypeVar("_T")


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


class PulsarPolicyError(LedgerError):
    """The namespace's policies are not what the backend needs and could not be applied."""


@runtime_checkable
class LedgerCatalog(Protocol):
    """Which ledgers exist, shared by every store on the same Pulsar cluster and namespace."""

    async def exists(self, ledger_id: int) -> bool: ...

    async def list_ids(self) -> list[int]: ...

    async def remove(self, ledger_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PulsarConfig:
    """How to reach Pulsar and how to use it. The defaults are safe for pulsar-lite; see
    :meth:`for_apache_pulsar` for a real cluster."""

    service_url: str
    #: ``http(s)://host:8080`` of the admin REST API; None: no topic deletion, no policy check.
    admin_url: str | None = None
    tenant: str = "public"
    namespace: str = "default"
    #: Prefix of the topic names (the Steward cluster's name), so clusters can share a namespace.
    cluster: str = "steward"
    auth_token: str | None = None
    #: CA bundle for ``pulsar+ssl://`` and ``https://`` admin URLs.
    tls_trust_certs_file: str | None = None
    tls_allow_insecure_connection: bool = False
    tls_validate_hostname: bool = True
    #: Client certificate and key, for brokers that require mutual TLS.
    tls_certificate_file: str | None = None
    tls_private_key_file: str | None = None
    #: Producer batching (pulsar-lite readers see duplicates and reorderings with it).
    batching: bool = False
    batching_max_publish_delay_ms: int = 1
    #: ``none``, ``lz4``, ``zlib``, ``zstd`` or ``snappy``.
    compression: str = "none"
    #: Reader receive queue (pulsar-lite needs 1).
    reader_queue_size: int = 1
    #: Use and rely on ``ExclusiveWithFencing`` producers (real Pulsar >= 2.11 only).
    fencing: bool = False
    send_timeout_ms: int = 30_000
    #: Bound of every client operation (creating producers and readers, closing, lookups).
    operation_timeout_s: float = 30.0
    #: Messages handed to the producer and not acknowledged yet; more appends wait here.
    max_pending_sends: int = 1000
    #: Group commit: the appends of one event-loop iteration (and those waiting for a free
    #: send slot) share messages of up to this many entry bytes.
    max_message_bytes: int = 1024 * 1024
    #: A reader that receives nothing this long although the broker has more starts over.
    reader_stall_s: float = 1.0
    #: Without a catalog: how long an open waits for the CREATED message of a ledger before
    #: calling it unknown.
    open_wait_s: float = 2.0
    extra_client_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("tenant", "namespace", "cluster"):
            value = getattr(self, name)
            if not _NAME_RE.match(value):
                raise ValueError(f"invalid Pulsar {name} {value!r}")
        if self.compression not in _COMPRESSION:
            raise ValueError(
                f"unknown compression {self.compression!r}; one of {', '.join(_COMPRESSION)}"
            )
        if self.reader_queue_size < 1 or self.max_pending_sends < 1:
            raise ValueError("reader_queue_size and max_pending_sends must be >= 1")

    @classmethod
    def for_pulsar_lite(cls, service_url: str, **overrides: Any) -> PulsarConfig:
        """Settings pulsar-lite 0.2.0 needs: no fencing, no batching, reader queue of 1."""
        return replace(cls(service_url), **overrides)

    @classmethod
    def for_apache_pulsar(
        cls, service_url: str, admin_url: str | None, **overrides: Any
    ) -> PulsarConfig:
        """A real Pulsar cluster (>= 2.11): fencing, batching, LZ4, a larger reader queue."""
        fast = cls(
            service_url,
            admin_url=admin_url,
            fencing=True,
            batching=True,
            compression="lz4",
            reader_queue_size=1000,
        )
        return replace(fast, **overrides)

    def topic(self, ledger_id: int) -> str:
        return f"persistent://{self.tenant}/{self.namespace}/{self.topic_name(ledger_id)}"

    def topic_name(self, ledger_id: int) -> str:
        return f"{self.cluster}-ledger-{ledger_id:012d}"

    def ledger_id_of(self, topic: str) -> int | None:
        """The ledger id of a topic of this cluster (full or short name), else None."""
        short = topic.rsplit("/", 1)[-1]
        prefix = f"{self.cluster}-ledger-"
        if short.startswith(prefix) and short[len(prefix) :].isdigit():
            return int(short[len(prefix) :])
        return None


def _error_for(exc: BaseException, what: str) -> LedgerError:
    """A ledger error for a Pulsar client exception."""
    if isinstance(exc, LedgerError):
        return exc
    if isinstance(exc, pulsar.ProducerFenced):
        return LedgerFencedError(f"{what}: the producer was fenced (the ledger was recovered)")
    if isinstance(exc, pulsar.TopicNotFound):
        return NoSuchLedgerError(f"{what}: topic not found")
    return LedgerError(f"{what}: {type(exc).__name__}: {exc}")


def _error_for_result(result: Any, what: str) -> LedgerError:
    if result == pulsar.Result.ProducerFenced:
        return LedgerFencedError(f"{what}: the producer was fenced (the ledger was recovered)")
    if result == pulsar.Result.TopicNotFound:
        return NoSuchLedgerError(f"{what}: topic not found")
    return LedgerError(f"{what}: Pulsar error {result}")


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """From a client thread. Never raises: an exception escaping a Pulsar callback kills the
    process, and a closed loop only means that nobody waits any more."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


class _ThreadInbox:
    """Items posted by client threads, drained on the loop in batches (one wakeup per batch)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, drain: Callable[[list[Any]], None]) -> None:
        self._loop = loop
        self._drain = drain
        self._lock = threading.Lock()
        self._items: list[Any] = []
        self._scheduled = False

    def post(self, item: Any) -> None:  # any thread
        try:
            with self._lock:
                self._items.append(item)
                if self._scheduled:
                    return
                self._scheduled = True
            _call_soon_threadsafe(self._loop, self.drain_now)
        except Exception:
            # Escaping a Pulsar callback, it would terminate the process.
            logger.exception("cannot hand a Pulsar client result to the event loop")

    def drain_now(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        if items:
            self._drain(items)


class PulsarLedgerWriter(LedgerWriter):
    """The producer of one ledger's topic; see the module docstring."""

    def __init__(self, store: PulsarLedgerStore, ledger_id: int, producer: Any) -> None:
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

    @property
    def ledger_id(self) -> int:
        return self._ledger_id

    @property
    def last_add_confirmed(self) -> int:
        return self._last_add_confirmed

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def append(self, data: bytes) -> asyncio.Future[int]:
        if len(data) > MAX_ENTRY_SIZE_BYTES:
            raise ValueError(f"entry of {len(data)} bytes exceeds {MAX_ENTRY_SIZE_BYTES}")
        future: asyncio.Future[int] = self._loop.create_future()
        if self._failure is not None:
            error_type, reason = self._failure
            future.set_exception(error_type(reason))
            return future
        if self._closed:
            future.set_exception(LedgerClosedError(f"writer of ledger {self._ledger_id} is closed"))
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


_Probe = asyncio.Future[bool | None]


class PulsarLedgerReader(LedgerReader):
    """Reads one ledger's topic through the Reader API; see the module docstring.

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
        self._entries: list[LedgerEntry] = []
        self._base_id = 0  # entry id of _entries[0]
        self._buffered_bytes = 0
        self._next_id = 0
        self._created = False
        self._seal_last: int | None = None  # the first SEAL: last entry id of the ledger
        self._deleted = False
        self._corrupt: str | None = None
        self._last_entry_id: int | None = None
        # Where a re-created reader starts (inclusive): the last message accepted.
        self._last_message_id: Any = None
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
        return self._seal_last

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
        if self._buffered_bytes > READER_BUFFER_BYTES:
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
        if len(data) < HEADER.size:
            self._corrupt = f"a message of {len(data)} bytes (shorter than the header)"
            return
        magic, kind, entry_id, lac = HEADER.unpack_from(data)
        if magic != MAGIC:
            self._corrupt = f"a message with magic {magic:#x}, not written by Steward"
            return
        if kind == Kind.ENTRIES:
            if self._deleted or (self._seal_last is not None and entry_id > self._seal_last):
                return  # past the end: a deposed writer's late append
            payloads = decode_entries(data)
            if payloads is None:
                self._corrupt = f"a message of entries from {entry_id} with broken framing"
                return
            if entry_id > self._next_id:
                self._restart_at_anomaly(f"entry {entry_id} while expecting {self._next_id}")
                return
            # Entries below the next id are duplicates (a producer resend, a redelivery).
            for offset in range(self._next_id - entry_id, len(payloads)):
                payload = payloads[offset]
                self._entries.append(LedgerEntry(self._ledger_id, entry_id + offset, lac, payload))
                self._buffered_bytes += len(payload)
                self._next_id += 1
                self._last_message_id = message_id
        elif kind == Kind.CREATED:
            if entry_id != self._ledger_id:
                self._corrupt = f"the CREATED marker of ledger {entry_id}"
            elif not self._created:
                self._created = True
                self._last_message_id = message_id
        elif kind == Kind.SEAL:
            if self._seal_last is None:
                self._seal_last = self._next_id - 1
                self._last_message_id = message_id
        elif kind == Kind.DELETED:
            self._deleted = True
        else:
            logger.warning(
                "ledger %d: ignoring a message of unknown kind %d", self._ledger_id, kind
            )

    def _restart_at_anomaly(self, what: str) -> bool:
        """A gap or a reordering: start over after the last accepted message, once per
        position (True); a second time at the same position it is what is stored (False)."""
        if self._retried_at == self._next_id:
            logger.info("ledger %d: %s again: it is stored that way", self._ledger_id, what)
            return False
        self._retried_at = self._next_id
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
        self._deleted = True
        self._wake()

    def _check_usable(self) -> None:
        if self._closed:
            raise LedgerClosedError(f"reader of ledger {self._ledger_id} is closed")
        if self._deleted:
            raise NoSuchLedgerError(f"ledger {self._ledger_id} was deleted")
        if self._corrupt is not None:
            raise LedgerError(f"topic {self._topic} of ledger {self._ledger_id}: {self._corrupt}")

    def _end(self) -> int:
        """One past the last entry a read may return now."""
        if self._seal_last is not None:
            return min(self._next_id, self._seal_last + 1)
        return self._next_id

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
        if not self._created:
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
            start = self._last_message_id
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
            self._deleted = True
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
        return more is True or (self._created and self._last_received_id is None)

    async def wait_for_first_message(self, timeout_s: float, *, exists: bool) -> bool:
        """Whether the ledger's CREATED marker arrives within ``timeout_s``; ``exists``: the
        ledger is known to exist (a reader receiving nothing then is stuck)."""
        deadline = self._loop.time() + timeout_s
        stall_s = self._store.config.reader_stall_s
        while not self._created:
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
        if first_entry_id < self._base_id:
            await self._rewind()
        self._trim(first_entry_id)
        wanted_end = first_entry_id + max_entries
        await self.settle(
            lambda: self._end() >= wanted_end or self._seal_last is not None,
            self._store.config.operation_timeout_s,
        )
        self._check_usable()
        end = min(self._end(), wanted_end)
        if first_entry_id >= end:
            return []
        return self._entries[first_entry_id - self._base_id : end - self._base_id]

    async def wait_for_entries(self, after_entry_id: int, timeout_s: float) -> bool:
        deadline = self._loop.time() + max(0.0, timeout_s)
        stall_s = self._store.config.reader_stall_s
        self._trim(after_entry_id + 1)
        while True:
            self._check_usable()
            if not await self._keep_going() and self._loop.time() >= deadline:
                return False  # cannot tell now (the broker is unreachable)
            if self._end() > after_entry_id + 1:
                return True
            if self._seal_last is not None:
                return False
            remaining_s = deadline - self._loop.time()
            if remaining_s <= 0:
                # "May be readable" must include what the broker held when we were called.
                await self.settle(
                    lambda: self._end() > after_entry_id + 1 or self._seal_last is not None,
                    self._store.config.operation_timeout_s,
                )
                self._check_usable()
                return self._end() > after_entry_id + 1
            delivered = await self._wait_delivery(min(remaining_s, stall_s))
            if not delivered and remaining_s > stall_s:
                more = await self._probe()
                progressed = more is True and self._handled_count > self._handled_at_probe
                if not progressed and self._stalled(more):
                    self._pump_error = _RestartReader("stalled: nothing arrives")

    def _trim(self, keep_from_id: int) -> None:
        """Forget entries before ``keep_from_id`` once the buffer is over its budget."""
        if self._buffered_bytes <= READER_BUFFER_BYTES:
            return
        drop = min(max(0, keep_from_id - self._base_id), len(self._entries))
        self._buffered_bytes -= sum(len(entry.data) for entry in self._entries[:drop])
        del self._entries[:drop]
        self._base_id += drop
        if self._buffered_bytes <= READER_BUFFER_BYTES and self._paused:
            self._paused = False
            self._pump_wake.set()

    async def _rewind(self) -> None:
        """Read from the start again (a read before what the buffer still holds)."""
        self._entries = []
        self._base_id = self._next_id = 0
        self._buffered_bytes = 0
        self._last_message_id = None
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


class PulsarLedgerStore(LedgerStore):
    """Ledgers as Pulsar topics; see the module docstring.

    ``ledger_ids`` allocates ids (never repeating, increasing); when it also implements
    :class:`LedgerCatalog` (the ZooKeeper allocator does) it is the catalog too, unless
    ``catalog`` names another one.
    """

    can_fence = False

    def __init__(
        self,
        config: PulsarConfig,
        ledger_ids: Callable[[], Awaitable[int]],
        *,
        catalog: LedgerCatalog | None = None,
        admin_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.can_fence = config.fencing
        self._ledger_ids = ledger_ids
        if catalog is None and isinstance(ledger_ids, LedgerCatalog):
            catalog = ledger_ids
        self._catalog = catalog
        self._admin_transport = admin_transport
        self._admin: httpx.AsyncClient | None = None
        self.client = _make_client(config)
        self._created: set[int] = set()  # created by this store and not deleted
        self._deleted: set[int] = set()
        self._ledger_writers: dict[int, PulsarLedgerWriter] = {}
        self._ledger_readers: dict[int, set[PulsarLedgerReader]] = {}
        self._highest_id = 0

    # -- helpers for writers and readers --------------------------------------------------

    async def blocking(self, what: str, func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run a blocking client call in a thread, bounded by the operation timeout."""
        timeout_s = self.config.operation_timeout_s + 1
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.to_thread(functools.partial(func, *args, **kwargs))
        except TimeoutError:
            raise LedgerError(f"cannot {what}: no answer from Pulsar in {timeout_s:g} s") from None
        except Exception as exc:
            raise _error_for(exc, f"cannot {what}") from exc

    async def close_quietly(self, handle: Any, what: str) -> None:
        """Close a producer or reader; failures only logged (nothing depends on them)."""
        try:
            await self.blocking(f"close the {what}", handle.close)
        except LedgerError as exc:
            logger.info("%s", exc)

    async def send_and_wait(self, producer: Any, payload: bytes, what: str) -> None:
        """Send one message and wait for its durable acknowledgement (bounded)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any) -> None:
            if not done.done():
                done.set_result(result)

        def sent(result: Any, message_id: Any) -> None:  # on a client thread
            _call_soon_threadsafe(loop, lambda: settle(result))

        try:
            producer.send_async(payload, sent)
            async with asyncio.timeout(self.config.send_timeout_ms / 1000 + 1):
                result = await done
        except TimeoutError:
            raise LedgerError(f"{what}: not acknowledged in time") from None
        except Exception as exc:
            raise _error_for(exc, what) from exc
        if result != pulsar.Result.Ok:
            raise _error_for_result(result, what)

    def forget(self, handle: LedgerWriter | LedgerReader) -> None:
        super().forget(handle)
        if isinstance(handle, PulsarLedgerWriter):
            if self._ledger_writers.get(handle.ledger_id) is handle:
                del self._ledger_writers[handle.ledger_id]
        elif isinstance(handle, PulsarLedgerReader):
            readers = self._ledger_readers.get(handle.ledger_id)
            if readers is not None:
                readers.discard(handle)
                if not readers:
                    del self._ledger_readers[handle.ledger_id]

    async def _create_producer(self, ledger_id: int) -> Any:
        config = self.config
        access_mode = (
            pulsar.ProducerAccessMode.ExclusiveWithFencing
            if config.fencing
            else pulsar.ProducerAccessMode.Shared
        )
        return await self.blocking(
            f"create a producer for ledger {ledger_id}",
            self.client.create_producer,
            config.topic(ledger_id),
            batching_enabled=config.batching,
            batching_max_publish_delay_ms=config.batching_max_publish_delay_ms,
            send_timeout_millis=config.send_timeout_ms,
            max_pending_messages=config.max_pending_sends,
            block_if_queue_full=False,
            compression_type=_COMPRESSION[config.compression],
            access_mode=access_mode,
        )

    async def _write_marker(self, ledger_id: int, kind: Kind) -> None:
        """SEAL or DELETED, through a producer of its own. With fencing, creating it fences
        the ledger's writer first (ExclusiveWithFencing)."""
        producer = await self._create_producer(ledger_id)
        try:
            await self.send_and_wait(
                producer, encode_message(kind, -1, -1), f"ledger {ledger_id}: {kind.name} marker"
            )
        finally:
            await self.close_quietly(producer, f"{kind.name} producer of ledger {ledger_id}")

    async def verify_fencing(self) -> bool:
        """Whether the broker enforces ``ExclusiveWithFencing``, tried on a scratch topic.

        Raises :class:`LedgerError` when ``PulsarConfig.fencing`` is set and the broker does
        not enforce it (pulsar-lite): ``can_fence`` would be a lie there. A start-up check.
        """
        self._check_open()
        topic = f"persistent://{self.config.tenant}/{self.config.namespace}/"
        topic += f"{self.config.cluster}-fencing-check"
        fencing_mode = pulsar.ProducerAccessMode.ExclusiveWithFencing
        create = functools.partial(
            self.client.create_producer, topic, batching_enabled=False, access_mode=fencing_mode
        )
        first = await self.blocking("create a fencing-check producer", create)
        try:
            second = await self.blocking("create a second fencing-check producer", create)
            await self.close_quietly(second, "fencing-check producer")
            try:
                await self.send_and_wait(first, b"fenced?", "fencing check")
                enforced = False
            except LedgerFencedError:
                enforced = True
        finally:
            await self.close_quietly(first, "fencing-check producer")
        if self.config.fencing and not enforced:
            raise LedgerError(
                f"PulsarConfig.fencing is set but {self.config.service_url} does not enforce "
                "ExclusiveWithFencing (pulsar-lite?): set fencing=False there"
            )
        return enforced

    # -- the LedgerStore interface ---------------------------------------------------------

    async def create_ledger(self) -> LedgerWriter:
        self._check_open()
        ledger_id = await self._ledger_ids()
        if ledger_id <= self._highest_id:
            raise LedgerError(
                f"the ledger id allocator returned {ledger_id} after {self._highest_id}"
            )
        self._highest_id = ledger_id
        try:
            producer = await self._create_producer(ledger_id)
            try:
                await self.send_and_wait(
                    producer,
                    encode_message(Kind.CREATED, ledger_id, -1),
                    f"ledger {ledger_id}: CREATED marker",
                )
            except BaseException:
                await self.close_quietly(producer, f"producer of ledger {ledger_id}")
                raise
        except BaseException:
            if self._catalog is not None:
                try:
                    await self._catalog.remove(ledger_id)
                except LedgerError as exc:
                    logger.warning("ledger %d: could not release its id: %s", ledger_id, exc)
            raise
        writer = PulsarLedgerWriter(self, ledger_id, producer)
        self._created.add(ledger_id)
        self._ledger_writers[ledger_id] = writer
        self._writers.add(writer)
        return writer

    async def open_ledger(self, ledger_id: int, *, recovery: bool) -> LedgerReader:
        self._check_open()
        if ledger_id in self._deleted or ledger_id < 1:
            raise NoSuchLedgerError(f"no ledger {ledger_id}")
        if self._catalog is not None and not await self._catalog.exists(ledger_id):
            raise NoSuchLedgerError(f"no ledger {ledger_id} (not in the catalog)")
        reader = PulsarLedgerReader(self, ledger_id)
        self._readers.add(reader)
        self._ledger_readers.setdefault(ledger_id, set()).add(reader)
        try:
            await reader.start()
            # With a catalog the ledger exists: wait as long as any operation for its first
            # message; without one, an unknown ledger's empty topic is told by a timeout.
            known = self._catalog is not None or ledger_id in self._created
            wait_s = self.config.operation_timeout_s if known else self.config.open_wait_s
            if not await reader.wait_for_first_message(wait_s, exists=known):
                raise NoSuchLedgerError(
                    f"no ledger {ledger_id}: topic {self.config.topic(ledger_id)} has no "
                    f"CREATED message (waited {wait_s:g} s)"
                )
            if recovery:
                await self._recover(reader)
        except BaseException:
            await reader.close()
            raise
        return reader

    async def _recover(self, reader: PulsarLedgerReader) -> None:
        ledger_id = reader.ledger_id
        writer = self._ledger_writers.get(ledger_id)
        if writer is not None:
            writer.fence_locally()
        # The first SEAL in the topic ends the ledger (ours, or an earlier one).
        await self._write_marker(ledger_id, Kind.SEAL)
        await reader.settle(
            lambda: reader.sealed_last_entry_id is not None, self.config.operation_timeout_s
        )
        last = reader.sealed_last_entry_id
        if last is None:
            raise LedgerError(f"ledger {ledger_id}: recovery did not find the SEAL it wrote")
        reader.mark_recovered(last)
        logger.info("ledger %d recovered: last entry %d", ledger_id, last)

    async def delete_ledger(self, ledger_id: int) -> None:
        self._check_open()
        writer = self._ledger_writers.get(ledger_id)
        if writer is not None:
            writer.on_deleted()
        known = ledger_id in self._created or ledger_id in self._ledger_readers
        if self._catalog is not None and not known:
            known = await self._catalog.exists(ledger_id)
        if known and ledger_id not in self._deleted:
            # In the topic, so readers in every process learn it (pulsar-lite keeps the topic).
            await self._write_marker(ledger_id, Kind.DELETED)
        if self._catalog is not None:
            await self._catalog.remove(ledger_id)
        self._created.discard(ledger_id)
        self._deleted.add(ledger_id)
        for reader in list(self._ledger_readers.get(ledger_id, ())):
            reader.mark_deleted()
        if self.config.admin_url is not None:
            await self._admin_delete_topic(ledger_id)

    async def list_ledgers(self) -> list[int]:
        self._check_open()
        if self._catalog is not None:
            return await self._catalog.list_ids()
        ids = set(self._created)
        if self.config.admin_url is not None:
            ids.update(await self._admin_list_ledgers())
        return sorted(ids - self._deleted)

    async def close(self) -> None:
        if self._closed:
            return
        await super().close()
        await self.close_quietly(self.client, "Pulsar client")
        if self._admin is not None:
            await self._admin.aclose()

    # -- admin REST API --------------------------------------------------------------------

    def _admin_client(self) -> httpx.AsyncClient:
        if self._admin is None:
            config = self.config
            assert config.admin_url is not None
            headers = {}
            if config.auth_token:
                headers["Authorization"] = f"Bearer {config.auth_token}"
            verify: bool | str = True
            if config.tls_allow_insecure_connection:
                verify = False
            elif config.tls_trust_certs_file:
                verify = config.tls_trust_certs_file
            cert = None
            if config.tls_certificate_file and config.tls_private_key_file:
                cert = (config.tls_certificate_file, config.tls_private_key_file)
            self._admin = httpx.AsyncClient(
                base_url=config.admin_url.rstrip("/"),
                headers=headers,
                timeout=config.operation_timeout_s,
                verify=verify,
                cert=cert,
                transport=self._admin_transport,
            )
        return self._admin

    def _topic_path(self, ledger_id: int) -> str:
        config = self.config
        return (
            f"/admin/v2/persistent/{config.tenant}/{config.namespace}/"
            f"{config.topic_name(ledger_id)}"
        )

    async def _admin_delete_topic(self, ledger_id: int) -> None:
        try:
            # force: the topic may still have our readers or a fenced producer attached.
            response = await self._admin_client().delete(
                self._topic_path(ledger_id), params={"force": "true"}
            )
        except httpx.HTTPError as exc:
            logger.warning("ledger %d: admin API delete failed: %s", ledger_id, exc)
            return
        if response.status_code not in (200, 204, 404):
            logger.warning(
                "ledger %d: admin API delete answered %d: %s",
                ledger_id,
                response.status_code,
                response.text[:200],
            )

    async def _admin_list_ledgers(self) -> list[int]:
        config = self.config
        try:
            response = await self._admin_client().get(
                f"/admin/v2/persistent/{config.tenant}/{config.namespace}"
            )
            response.raise_for_status()
            topics = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("cannot list topics through the admin API: %s", exc)
            return []
        ids = [config.ledger_id_of(topic) for topic in topics if isinstance(topic, str)]
        return [ledger_id for ledger_id in ids if ledger_id is not None]

    async def ensure_namespace_retention(self) -> None:
        """Check the namespace's policies and apply what the backend needs (module doc).

        Without an admin URL this only logs that it cannot check. Raises
        :class:`PulsarPolicyError` when the admin API refuses or the namespace is missing.
        """
        config = self.config
        namespace = f"{config.tenant}/{config.namespace}"
        if config.admin_url is None:
            logger.info(
                "no Pulsar admin URL: not checking namespace %s; it must have infinite "
                "retention and no inactive-topic deletion (see log/pulsar.py)",
                namespace,
            )
            return
        base = f"/admin/v2/namespaces/{namespace}"
        policies = await self._admin_json("GET", base, None, f"read the policies of {namespace}")
        if not isinstance(policies, dict):
            raise PulsarPolicyError(f"unexpected policies of namespace {namespace}: {policies!r}")
        retention = policies.get("retention_policies") or {}
        if (
            retention.get("retentionTimeInMinutes") != -1
            or retention.get("retentionSizeInMB") != -1
        ):
            await self._admin_json(
                "POST",
                f"{base}/retention",
                {"retentionTimeInMinutes": -1, "retentionSizeInMB": -1},
                f"set infinite retention on {namespace}",
            )
            logger.info("namespace %s: retention set to infinite (was %s)", namespace, retention)
        inactive = policies.get("inactive_topic_policies")
        if not isinstance(inactive, dict) or inactive.get("deleteWhileInactive", True):
            await self._admin_json(
                "POST",
                f"{base}/inactiveTopicPolicies",
                {
                    "inactiveTopicDeleteMode": "delete_when_no_subscriptions",
                    "maxInactiveDurationSeconds": 3600,
                    "deleteWhileInactive": False,
                },
                f"disable inactive-topic deletion on {namespace}",
            )
            logger.info("namespace %s: inactive-topic deletion disabled", namespace)

    async def _admin_json(self, method: str, path: str, body: Any, what: str) -> Any:
        try:
            response = await self._admin_client().request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise PulsarPolicyError(f"cannot {what}: admin API unreachable: {exc}") from exc
        if response.status_code in (401, 403):
            raise PulsarPolicyError(
                f"cannot {what}: the admin API refused ({response.status_code}); the token "
                "needs admin rights on the tenant, or apply the policy by hand (log/pulsar.py)"
            )
        if response.status_code == 404:
            raise PulsarPolicyError(
                f"cannot {what}: not found (404); create the tenant and namespace first "
                f"(pulsar-admin namespaces create {self.config.tenant}/{self.config.namespace})"
            )
        if response.status_code >= 300:
            raise PulsarPolicyError(
                f"cannot {what}: admin API answered {response.status_code}: {response.text[:200]}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise PulsarPolicyError(f"cannot {what}: the answer is not JSON") from exc


def _make_client(config: PulsarConfig) -> Any:
    if CLIENT_LOGGER.level == logging.NOTSET:
        CLIENT_LOGGER.setLevel(logging.WARNING)
    options: dict[str, Any] = {
        "operation_timeout_seconds": max(1, math.ceil(config.operation_timeout_s)),
        "connection_timeout_ms": max(1000, int(config.operation_timeout_s * 1000)),
        "logger": CLIENT_LOGGER,
        "tls_allow_insecure_connection": config.tls_allow_insecure_connection,
        "tls_validate_hostname": config.tls_validate_hostname,
    }
    if config.auth_token:
        options["authentication"] = pulsar.AuthenticationToken(config.auth_token)
    if config.tls_trust_certs_file:
        options["tls_trust_certs_file_path"] = config.tls_trust_certs_file
    if config.tls_certificate_file:
        options["tls_certificate_file_path"] = config.tls_certificate_file
    if config.tls_private_key_file:
        options["tls_private_key_file_path"] = config.tls_private_key_file
    options.update(config.extra_client_options)
    return pulsar.Client(config.service_url, **options)
