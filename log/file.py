"""File ledger backend (docs/DESIGN.md §3): one segment file of CRC-framed entries per ledger.

Layout of the store's directory:

- ``ledger-<id:012d>.log``: the entries, each framed as ``FRAME_HEADER`` (big-endian
  ``[u32 payload length][u32 crc32][u64 entry id][i64 last add confirmed]``) and the payload.
  The crc32 (zlib) covers entry id, last add confirmed and payload. The valid data of a
  segment ends at the first frame that is incomplete, fails its CRC or does not carry the
  next entry id, so a torn tail (crash during a write) is simply not part of the ledger.
- ``ledger-<id:012d>.fencing``: written by recovery first, before it measures the ledger.
  Its existence fences the writer (see below).
- ``ledger-<id:012d>.fenced``: written by recovery (JSON: recovered last entry id and valid
  length). Its existence fences the writer; every reader stops at the recorded length.
- ``next-id`` and ``next-id.lock``: the next ledger id, allocated under ``flock`` so ids keep
  increasing across restarts and across processes (also after the newest ledger was deleted).

Fencing across processes on one host: recovery creates the ``.fencing`` marker, then
measures the valid prefix, writes the ``.fenced`` marker and truncates. The writer checks
for either marker before each batch's write and again after its fdatasync, and fails the
batch if one exists: a batch is acknowledged only when its bytes were in the file before
the ``.fencing`` marker was created, hence before recovery measured the ledger. A writer
frozen in the middle of a batch (SIGSTOP) therefore cannot block recovery, and nothing it
writes later is ever acknowledged. Both also take ``flock`` on the segment file (the writer
around each batch, recovery while it measures, waiting for it a bounded time only), which
keeps a live writer's batch whole instead of cut by the measurement.

Group commit: ``append`` only queues; one flusher task per writer writes everything queued
with one write and one fdatasync in a worker thread, and appends arriving meanwhile form the
next batch. A batch of one entry is written on the event loop itself while fdatasync is fast
(no thread hand-offs for a lone caller; see ``FileLedgerWriter._write_inline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import struct
import time
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, TypeVarTuple

import msgspec

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
from log.private_fs import FILE_MODE, make_private_dirs

logger = logging.getLogger(__name__)

#: Frame header: payload length, crc32, entry id, last add confirmed.
FRAME_HEADER = struct.Struct(">IIQq")
_CRC_PREFIX = struct.Struct(">Qq")
#: Larger frames are rejected by the writer and end the valid data for readers, so a
#: corrupted length field cannot make a reader wait for gigabytes that never come.
MAX_ENTRY_SIZE_BYTES = 64 * 1024 * 1024
_SCAN_CHUNK_BYTES = 1024 * 1024
_LEDGER_FILE_RE = re.compile(r"^ledger-(\d+)\.(log|fenced|fencing)$")
#: A lone append is written and synced on the event loop while a batch's write + fdatasync
#: takes less than this on average; above it the loop would stall, so a worker thread does it.
INLINE_SYNC_MAX_S = 0.002
#: How long recovery waits for a writer's batch in progress before measuring without it.
RECOVERY_LOCK_WAIT_S = 0.5
_NEXT_ID_FILE = "next-id"
_NEXT_ID_LOCK_FILE = "next-id.lock"

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


async def _in_thread(func: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
    """Run blocking disk IO in the default executor, never on the event loop thread.

    OS errors come out as :class:`LedgerError`, so callers need to catch only that.
    """
    try:
        return await asyncio.get_running_loop().run_in_executor(None, func, *args)
    except OSError as exc:
        raise LedgerError(f"IO error: {exc}") from exc


def frame_crc(entry_id: int, last_add_confirmed: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_CRC_PREFIX.pack(entry_id, last_add_confirmed)))


def encode_frame(entry_id: int, last_add_confirmed: int, payload: bytes) -> bytes:
    """One framed entry as stored in a segment file."""
    crc = frame_crc(entry_id, last_add_confirmed, payload)
    return FRAME_HEADER.pack(len(payload), crc, entry_id, last_add_confirmed) + payload


def _encode_batch(payloads: list[bytes], first_entry_id: int, last_add_confirmed: int) -> bytes:
    pack = FRAME_HEADER.pack
    parts: list[bytes] = []
    for offset, payload in enumerate(payloads):
        entry_id = first_entry_id + offset
        crc = frame_crc(entry_id, last_add_confirmed, payload)
        parts.append(pack(len(payload), crc, entry_id, last_add_confirmed))
        parts.append(payload)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: str) -> None:
    # Makes file creations, renames and unlinks in ``directory`` durable.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` so readers see the old or the new content, never a mix.

    Callers serialise writers of one path (flock), so a fixed temporary name is safe.
    """
    tmp_path = path + ".tmp"
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a temporary file left by an older version may be 0644
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp_path, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _lock_with_timeout(fd: int, timeout_s: float) -> bool:
    """flock(LOCK_EX), giving up after ``timeout_s``; True when the lock is held."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def _unlink_if_exists(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass(frozen=True, slots=True)
class _FenceMarker:
    last_entry_id: int
    length_bytes: int


def _read_marker(path: str) -> _FenceMarker | None:
    try:
        with open(path, "rb") as marker_file:
            raw = marker_file.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        return _FenceMarker(int(doc["last_entry_id"]), int(doc["length_bytes"]))
    except (ValueError, KeyError, TypeError) as exc:
        # Written atomically, so this means the disk itself is damaged: refuse to guess.
        raise LedgerError(f"corrupt fence marker {path}: {exc}") from exc


def _write_marker(path: str, marker: _FenceMarker) -> None:
    doc = {
        "last_entry_id": marker.last_entry_id,
        "length_bytes": marker.length_bytes,
        "fenced_ms": int(time.time() * 1000),
    }
    _atomic_write(path, json.dumps(doc).encode())


class _FrameIndex:
    """Start offsets of the valid frames of one segment, extended incrementally by scanning.

    Only used by one thread at a time (the owner serialises calls).
    """

    def __init__(self, fd: int, ledger_id: int) -> None:
        self.fd = fd
        self.ledger_id = ledger_id
        # offsets[k] is where entry k's frame starts; 8 bytes per entry.
        self.offsets = array("q")
        # End of the last valid frame: scanning resumes here, so tailing is incremental.
        self.valid_end_bytes = 0
        # File size at which the last scan hit the end of the valid data (None: it stopped
        # because it had found enough). Rescanning only helps once the size changes.
        self.exhausted_at_size_bytes: int | None = None

    @property
    def count(self) -> int:
        return len(self.offsets)

    def scan(
        self, until_count: int, collect_from: int, size_bytes: int, limit_bytes: int | None
    ) -> list[LedgerEntry]:
        """Index new frames until ``until_count`` are known or the valid data ends.

        Returns the newly found entries with id >= ``collect_from`` (so a tailing read needs
        no second pass over the bytes it just validated).
        """
        end_bytes = size_bytes if limit_bytes is None else min(size_bytes, limit_bytes)
        collected: list[LedgerEntry] = []
        pos = self.valid_end_bytes
        entry_id = self.count
        buf = b""
        buf_start = pos
        header_size = FRAME_HEADER.size
        exhausted = True
        while end_bytes - pos >= header_size:
            if entry_id >= until_count:
                exhausted = False
                break
            rel = pos - buf_start
            if len(buf) - rel < header_size:
                buf = os.pread(self.fd, min(_SCAN_CHUNK_BYTES, end_bytes - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < header_size:
                    break  # the file shrank under us (truncated by recovery)
            length, crc, frame_entry_id, lac = FRAME_HEADER.unpack_from(buf, rel)
            frame_end = pos + header_size + length
            if length > MAX_ENTRY_SIZE_BYTES or frame_entry_id != entry_id or frame_end > end_bytes:
                break
            if frame_end - buf_start > len(buf):
                buf = os.pread(self.fd, max(_SCAN_CHUNK_BYTES, frame_end - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < frame_end - pos:
                    break
            payload = memoryview(buf)[rel + header_size : rel + header_size + length]
            if frame_crc(frame_entry_id, lac, payload) != crc:
                break
            self.offsets.append(pos)
            if entry_id >= collect_from:
                collected.append(LedgerEntry(self.ledger_id, entry_id, lac, bytes(payload)))
            entry_id += 1
            pos = frame_end
        self.valid_end_bytes = pos
        self.exhausted_at_size_bytes = size_bytes if exhausted else None
        return collected

    def read_indexed(self, first_entry_id: int, end_entry_id: int) -> list[LedgerEntry]:
        """Entries ``[first, end)``, all already indexed (validated) by :meth:`scan`."""
        start = self.offsets[first_entry_id]
        stop = self.offsets[end_entry_id] if end_entry_id < self.count else self.valid_end_bytes
        buf = os.pread(self.fd, stop - start, start)
        if len(buf) != stop - start:
            raise LedgerError(f"segment of ledger {self.ledger_id} shrank under a reader")
        view = memoryview(buf)
        entries: list[LedgerEntry] = []
        rel = 0
        header_size = FRAME_HEADER.size
        for entry_id in range(first_entry_id, end_entry_id):
            length, _, frame_entry_id, lac = FRAME_HEADER.unpack_from(buf, rel)
            if frame_entry_id != entry_id:
                raise LedgerError(f"segment of ledger {self.ledger_id} changed under a reader")
            rel += header_size
            entries.append(
                LedgerEntry(self.ledger_id, entry_id, lac, bytes(view[rel : rel + length]))
            )
            rel += length
        return entries


class FileLedgerWriter(LedgerWriter):
    """The writer of one segment file; see the module docstring for group commit and fencing."""

    def __init__(self, store: FileLedgerStore, ledger_id: int, fd: int) -> None:
        self._store = store
        self._ledger_id = ledger_id
        self._fd = fd
        self._marker_path = store.marker_path(ledger_id)
        self._fencing_path = store.fencing_path(ledger_id)
        self._next_entry_id = 0
        self._last_add_confirmed = -1
        self._size_bytes = 0
        self._pending: list[tuple[int, bytes, asyncio.Future[int]]] = []
        self._flush_task: asyncio.Task[None] | None = None
        # Once set, the writer is unusable: every later append fails with this.
        self._failure: tuple[type[LedgerError], str] | None = None
        self._closed = False
        # Moving average of a batch's write + fdatasync: lone appends are written on the
        # loop thread only while it is small (see _write_inline).
        self._sync_ewma_s = 0.0

    def append(self, data: bytes) -> asyncio.Future[int]:
        if len(data) > MAX_ENTRY_SIZE_BYTES:
            raise ValueError(f"entry of {len(data)} bytes exceeds {MAX_ENTRY_SIZE_BYTES}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        if self._refuse_append(future, self._failure):
            return future
        entry_id = self._next_entry_id
        self._next_entry_id += 1
        self._size_bytes += FRAME_HEADER.size + len(data)
        self._pending.append((entry_id, bytes(data), future))
        if self._flush_task is None:
            # Starts on the next loop iteration: appends made in this one join the batch,
            # and a lone append is not delayed by any timer.
            self._flush_task = loop.create_task(self._flush_loop())
        return future

    async def _flush_loop(self) -> None:
        batch: list[tuple[int, bytes, asyncio.Future[int]]] = []
        try:
            while self._pending and self._failure is None:
                batch, self._pending = self._pending, []
                payloads = [payload for _, payload, _ in batch]
                lac = self.lac_to_stamp(self._last_add_confirmed)
                try:
                    if not (len(batch) == 1 and self._write_inline(payloads, batch[0][0], lac)):
                        await _in_thread(self._write_batch_sync, payloads, batch[0][0], lac)
                except Exception as exc:
                    # Never retried: after a failed fsync the page cache may have dropped
                    # the dirty data, so a later "successful" fsync would prove nothing.
                    error_type = type(exc) if isinstance(exc, LedgerError) else LedgerError
                    if error_type is not LedgerFencedError:
                        logger.error("ledger %d: write failed: %s", self._ledger_id, exc)
                    self._fail(error_type, f"ledger {self._ledger_id}: {exc}", batch)
                    return
                self._last_add_confirmed = batch[-1][0]
                for entry_id, _, future in batch:
                    # A cancelled future's entry is durable anyway; nothing to undo.
                    if not future.done():
                        future.set_result(entry_id)
                batch = []
                self._store.notify_appended(self._ledger_id)
        except asyncio.CancelledError:
            # The batch's fate is unknown (its thread may still run): the writer is done.
            self._fail(LedgerError, f"ledger {self._ledger_id}: flush cancelled", batch)
            raise
        finally:
            self._flush_task = None

    def _write_inline(self, payloads: list[bytes], first_entry_id: int, lac: int) -> bool:
        """Write a lone entry on the loop thread; False: not done, use the worker thread.

        A lone append means nobody else is waiting to join its batch, so the hand-offs to
        a worker thread and back (two thread wake-ups, more than the fdatasync itself
        here) are pure latency. Only while fdatasync is fast (a slow disk must not stall
        the loop), and never waiting for the segment's lock (recovery may hold it).
        """
        if self._sync_ewma_s > INLINE_SYNC_MAX_S:
            return False
        return self._write_batch_sync(payloads, first_entry_id, lac, blocking=False)

    def _write_batch_sync(
        self,
        payloads: list[bytes],
        first_entry_id: int,
        last_add_confirmed: int,
        *,
        blocking: bool = True,
    ) -> bool:
        """Write and fdatasync one batch; False only when not ``blocking`` and the
        segment's lock is taken (nothing was written)."""
        data = _encode_batch(payloads, first_entry_id, last_add_confirmed)
        started = time.monotonic()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            if self._fenced():
                raise LedgerFencedError("fenced by recovery")
            if os.fstat(self._fd).st_nlink == 0:
                raise NoSuchLedgerError("deleted")
            _write_all(self._fd, data)
            os.fdatasync(self._fd)
            # A recovery that did not wait for our lock (we may have been frozen holding
            # it) may have measured the ledger before these bytes: then its marker exists
            # now and the batch must not be acknowledged.
            if self._fenced():
                raise LedgerFencedError("fenced by recovery during the write")
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        # Batches in the worker thread keep it current too (one writer at a time).
        self._sync_ewma_s += (time.monotonic() - started - self._sync_ewma_s) / 8
        return True

    def _fenced(self) -> bool:
        return os.path.exists(self._fencing_path) or os.path.exists(self._marker_path)

    def _fail(
        self,
        error_type: type[LedgerError],
        reason: str,
        batch: list[tuple[int, bytes, asyncio.Future[int]]],
    ) -> None:
        if self._failure is None:
            self._failure = (error_type, reason)
            if error_type is LedgerFencedError:
                logger.info("ledger %d: writer fenced", self._ledger_id)
        failed, self._pending = batch + self._pending, []
        for _, _, future in failed:
            if not future.done():
                # One instance per future: re-raising a shared exception grows its traceback.
                future.set_exception(error_type(reason))

    async def close(self) -> int:
        """Drain pending appends and close; returns the last durable entry id (-1: none)."""
        self._closed = True
        task = self._flush_task
        if task is not None:
            # asyncio.wait does not cancel the flush if close() itself is cancelled.
            await asyncio.wait({task})
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._store.forget(self)
        return self._last_add_confirmed


class FileLedgerReader(LedgerReader):
    """Reads (and tails) one segment file; never past a fence marker's recorded length."""

    def __init__(
        self,
        store: FileLedgerStore,
        index: _FrameIndex,
        marker: _FenceMarker | None,
        *,
        recovered: bool,
    ) -> None:
        self._store = store
        self._index = index
        self._ledger_id = index.ledger_id
        self._marker_path = store.marker_path(index.ledger_id)
        self._marker = marker
        self._last_entry_id = marker.last_entry_id if recovered and marker is not None else None
        # Serialises the worker-thread IO on the fd and index (and close against it).
        self._io_lock = asyncio.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerClosedError(f"reader of ledger {self._ledger_id} is closed")

    def _size_sync(self) -> int:
        stat = os.fstat(self._index.fd)
        if stat.st_nlink == 0:
            raise NoSuchLedgerError(f"ledger {self._ledger_id} was deleted")
        return stat.st_size

    def _limits_sync(self, until_count: int) -> tuple[int, int | None]:
        # Looked up before scanning: frames found after a fence can only be ones recovery
        # kept, and once the marker is known it caps everything.
        if self._marker is None:
            self._marker = _read_marker(self._marker_path)
        if self._marker is None:
            return until_count, None
        return min(until_count, self._marker.last_entry_id + 1), self._marker.length_bytes

    async def read(self, first_entry_id: int, max_entries: int) -> list[LedgerEntry]:
        if first_entry_id < 0 or max_entries < 0:
            raise ValueError(f"bad range: first={first_entry_id} max={max_entries}")
        self._check_open()
        async with self._io_lock:
            self._check_open()
            return await _in_thread(self._read_sync, first_entry_id, max_entries)

    def _read_sync(self, first_entry_id: int, max_entries: int) -> list[LedgerEntry]:
        size_bytes = self._size_sync()
        end_entry_id, limit_bytes = self._limits_sync(first_entry_id + max_entries)
        index = self._index
        known = index.count
        entries: list[LedgerEntry] = []
        if first_entry_id < min(known, end_entry_id):
            entries = index.read_indexed(first_entry_id, min(known, end_entry_id))
        if end_entry_id > known:
            entries.extend(index.scan(end_entry_id, first_entry_id, size_bytes, limit_bytes))
        return entries

    def _scan_sync(self, until_count: int) -> None:
        size_bytes = self._size_sync()
        until_count, limit_bytes = self._limits_sync(until_count)
        self._index.scan(until_count, until_count, size_bytes, limit_bytes)

    async def wait_for_entries(self, after_entry_id: int, timeout_s: float) -> bool:
        """Poll the file size (and get woken by writers of the same store) until entry
        ``after_entry_id + 1`` is valid in the file, or ``timeout_s`` passes."""
        self._check_open()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        index = self._index
        while True:
            # Re-checked every round: close() may have released the fd while we slept.
            self._check_open()
            if index.count > after_entry_id + 1:
                return True
            # fstat is cheap enough for the loop thread; it only tells whether to scan.
            size_bytes = self._size_sync()
            if size_bytes > index.valid_end_bytes and size_bytes != index.exhausted_at_size_bytes:
                async with self._io_lock:
                    self._check_open()
                    await _in_thread(self._scan_sync, after_entry_id + 2)
                if index.count > after_entry_id + 1:
                    return True
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                return False
            await self._store.wait_for_append(
                self._ledger_id, min(self._store.poll_interval_s, remaining_s)
            )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._io_lock:
            os.close(self._index.fd)
        self._store.forget(self)


class FileLedgerStore(LedgerStore):
    """Ledgers as segment files in one directory, shareable by processes on one host."""

    can_fence = True

    def __init__(
        self, directory: str | os.PathLike[str], *, poll_interval_s: float = 0.005
    ) -> None:
        super().__init__()
        self._directory = os.fspath(directory)
        make_private_dirs(self._directory)
        #: How often a tailing reader checks the segment's size.
        self.poll_interval_s = poll_interval_s
        self._append_waiters: dict[int, set[asyncio.Future[None]]] = {}

    @property
    def directory(self) -> str:
        return self._directory

    def log_path(self, ledger_id: int) -> str:
        return os.path.join(self._directory, f"ledger-{ledger_id:012d}.log")

    def fencing_path(self, ledger_id: int) -> str:
        return os.path.join(self._directory, f"ledger-{ledger_id:012d}.fencing")

    def marker_path(self, ledger_id: int) -> str:
        return os.path.join(self._directory, f"ledger-{ledger_id:012d}.fenced")

    # -- creation ---------------------------------------------------------------------------

    async def create_ledger(self) -> LedgerWriter:
        self._check_open()
        ledger_id, fd = await _in_thread(self._create_sync)
        writer = FileLedgerWriter(self, ledger_id, fd)
        self._writers.add(writer)
        return writer

    def _scan_ids_sync(self) -> dict[int, set[str]]:
        ids: dict[int, set[str]] = {}
        for name in os.listdir(self._directory):
            match = _LEDGER_FILE_RE.match(name)
            if match:
                ids.setdefault(int(match.group(1)), set()).add(match.group(2))
        return ids

    def _read_next_id_sync(self) -> int:
        path = os.path.join(self._directory, _NEXT_ID_FILE)
        try:
            with open(path, "rb") as next_id_file:
                return int(next_id_file.read().strip())
        except FileNotFoundError:
            return 1
        except ValueError:
            # Replaced atomically, so only disk damage gets here; the directory scan below
            # still keeps ids above every ledger present.
            logger.warning("unreadable %s; falling back to the directory scan", path)
            return 1

    def _create_sync(self) -> tuple[int, int]:
        lock_fd = os.open(
            os.path.join(self._directory, _NEXT_ID_LOCK_FILE), os.O_RDWR | os.O_CREAT, FILE_MODE
        )
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            on_disk = self._scan_ids_sync()
            ledger_id = max(self._read_next_id_sync(), max(on_disk, default=0) + 1)
            path = self.log_path(ledger_id)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, FILE_MODE)
            try:
                # Its directory fsync also makes the new segment's name durable.
                _atomic_write(
                    os.path.join(self._directory, _NEXT_ID_FILE), f"{ledger_id + 1}\n".encode()
                )
            except BaseException:
                os.close(fd)
                _unlink_if_exists(path)
                raise
            return ledger_id, fd
        finally:
            os.close(lock_fd)  # also releases the flock

    # -- reading and recovery ---------------------------------------------------------------

    async def open_ledger(self, ledger_id: int, *, recovery: bool) -> LedgerReader:
        self._check_open()
        marker: _FenceMarker | None
        if recovery:
            index, marker = await _in_thread(self._recover_sync, ledger_id)
        else:
            index, marker = await _in_thread(self._open_sync, ledger_id)
        reader = FileLedgerReader(self, index, marker, recovered=recovery)
        self._readers.add(reader)
        return reader

    def _open_fd_sync(self, ledger_id: int, flags: int) -> int:
        try:
            return os.open(self.log_path(ledger_id), flags)
        except FileNotFoundError:
            raise NoSuchLedgerError(f"no ledger {ledger_id}") from None

    def _open_sync(self, ledger_id: int) -> tuple[_FrameIndex, _FenceMarker | None]:
        fd = self._open_fd_sync(ledger_id, os.O_RDONLY)
        try:
            return _FrameIndex(fd, ledger_id), _read_marker(self.marker_path(ledger_id))
        except BaseException:
            os.close(fd)
            raise

    def _recover_sync(self, ledger_id: int) -> tuple[_FrameIndex, _FenceMarker]:
        fd = self._open_fd_sync(ledger_id, os.O_RDWR)
        try:
            index = _FrameIndex(fd, ledger_id)
            fencing_path = self.fencing_path(ledger_id)
            if not os.path.exists(self.marker_path(ledger_id)):
                # Before measuring: from now on the writer acknowledges nothing more.
                fencing_fd = os.open(fencing_path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
                try:
                    os.fsync(fencing_fd)
                finally:
                    os.close(fencing_fd)
                _fsync_dir(self._directory)
            # Waits (bounded) for the writer's batch in progress, which then counts as
            # written; a writer frozen while holding the lock is not waited for.
            locked = _lock_with_timeout(fd, RECOVERY_LOCK_WAIT_S)
            if not locked:
                logger.warning(
                    "ledger %d: the writer holds its lock (frozen?); recovering without it",
                    ledger_id,
                )
            try:
                stat = os.fstat(fd)
                if stat.st_nlink == 0:
                    raise NoSuchLedgerError(f"ledger {ledger_id} was deleted")
                marker_path = self.marker_path(ledger_id)
                marker = _read_marker(marker_path)
                if marker is None:
                    index.scan(2**62, 2**62, stat.st_size, None)
                    marker = _FenceMarker(index.count - 1, index.valid_end_bytes)
                    # Marker before truncation: after a crash in between, readers still
                    # stop at the recorded length and the next recovery truncates again.
                    _write_marker(marker_path, marker)
                    logger.info("ledger %d fenced at entry %d", ledger_id, marker.last_entry_id)
                if stat.st_size > marker.length_bytes:
                    logger.warning(
                        "ledger %d: cutting %d bytes of torn or corrupt tail after entry %d",
                        ledger_id,
                        stat.st_size - marker.length_bytes,
                        marker.last_entry_id,
                    )
                    os.ftruncate(fd, marker.length_bytes)
                    os.fsync(fd)
            finally:
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            return index, marker
        except BaseException:
            os.close(fd)
            raise

    async def wait_for_append(self, ledger_id: int, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``; a writer of this store appending to the ledger wakes us."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._append_waiters.setdefault(ledger_id, set())
        waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout_s)
        finally:
            waiters.discard(waiter)
            if not waiters:
                self._append_waiters.pop(ledger_id, None)

    def notify_appended(self, ledger_id: int) -> None:
        for waiter in self._append_waiters.get(ledger_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    # -- deletion, listing, closing ---------------------------------------------------------

    async def delete_ledger(self, ledger_id: int) -> None:
        self._check_open()
        await _in_thread(self._delete_sync, ledger_id)
        # Tailing readers of this store notice at once instead of at their next poll.
        self.notify_appended(ledger_id)

    def _delete_sync(self, ledger_id: int) -> None:
        # The segment first: a crash that leaves only a marker leaves no ledger behind.
        marker_path = self.marker_path(ledger_id)
        for path in (
            self.log_path(ledger_id),
            marker_path,
            marker_path + ".tmp",
            self.fencing_path(ledger_id),
        ):
            _unlink_if_exists(path)
        _fsync_dir(self._directory)

    async def list_ledgers(self) -> list[int]:
        self._check_open()
        ids = await _in_thread(self._scan_ids_sync)
        return sorted(ledger_id for ledger_id, kinds in ids.items() if "log" in kinds)


class _LedgerListDocument(msgspec.Struct):
    version: int
    ledger_list: LedgerList


class FileLedgerListStore(LedgerListStore):
    """The ledger list as a JSON file, replaced atomically; compare-and-set under flock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._lock_path = self._path + ".lock"
        make_private_dirs(os.path.dirname(os.path.abspath(self._path)))

    @property
    def path(self) -> str:
        return self._path

    async def get(self) -> tuple[LedgerList, int]:
        return await _in_thread(self._get_sync)

    def _get_sync(self) -> tuple[LedgerList, int]:
        try:
            with open(self._path, "rb") as list_file:
                raw = list_file.read()
        except FileNotFoundError:
            return LedgerList(), -1
        try:
            doc = msgspec.json.decode(raw, type=_LedgerListDocument)
        except msgspec.DecodeError as exc:
            raise LedgerError(f"corrupt ledger list {self._path}: {exc}") from exc
        return doc.ledger_list, doc.version

    async def compare_and_set(self, new: LedgerList, expected_version: int) -> int:
        return await _in_thread(self._compare_and_set_sync, new, expected_version)

    def _compare_and_set_sync(self, new: LedgerList, expected_version: int) -> int:
        lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            # The data file is replaced by rename, so the lock lives in a file of its own.
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            _, version = self._get_sync()
            if version != expected_version:
                raise BadVersionError(
                    f"ledger list is at version {version}, expected {expected_version}"
                )
            document = _LedgerListDocument(version=version + 1, ledger_list=new)
            _atomic_write(self._path, msgspec.json.encode(document))
            return version + 1
        finally:
            os.close(lock_fd)
