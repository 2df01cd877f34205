"""Snapshot file format (docs/DESIGN.md §5): one file = header + zstd-compressed opaque state body.

Layout::

    8 bytes   magic b"STWSNAP\\x01"
    4 bytes   header length, big-endian unsigned
    N bytes   header: msgpack map with the fields of :class:`SnapshotHeader`,
              plus ``header_crc32`` and ``pad`` (see below)
    rest      the body as one zstd frame (content size and zstd checksum included)

``checksum`` is the hex **SHA-256 of the compressed body** (the bytes after the
header, exactly as stored), so a file can be checked before decompressing it.
``body_size_bytes`` is the uncompressed size, ``compressed_size_bytes`` the
stored size; both are verified on read.

``header_crc32`` is the CRC-32 of the msgpack encoding of exactly the
:class:`SnapshotHeader` fields in declaration order (the reader re-encodes the
decoded header to check it). Without it a damaged position would go unnoticed
in a downloaded file, and the state would be replayed from the wrong entry.

The header comes first but holds values only known after compression (size,
checksum). To compress in one streaming pass, the writer reserves the header
with widest-possible placeholder values, streams the body, then rewrites the
header in place. msgpack ints shrink with their value, so the real header is
padded back to the reserved length with a ``pad`` bin field, which readers
ignore (msgspec drops unknown map keys; ``pad`` is outside the CRC).

Files are written to a temp file in the target directory, fsynced, renamed to
``snapshot-<ledger_id:012d>-<entry_id:012d>.snap`` and the directory fsynced:
readers see either nothing or a complete file.

All functions here do blocking IO; call them from a worker thread.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import struct
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, BinaryIO, cast

import msgspec
import zstandard

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "CorruptSnapshotError",
    "ForeignSnapshotError",
    "NewerSnapshotVersionError",
    "SnapshotError",
    "SnapshotHeader",
    "SnapshotInfo",
    "UnsupportedSnapshotVersionError",
    "install_snapshot_file",
    "parse_snapshot_file_name",
    "read_header",
    "read_snapshot",
    "snapshot_file_name",
    "verify_snapshot_file",
    "write_snapshot",
]

MAGIC = b"STWSNAP\x01"
FORMAT_VERSION = 1
DEFAULT_COMPRESSION_LEVEL = 3

# Prefix/suffix of in-progress files; SnapshotStore deletes leftovers of crashed writers.
TEMP_PREFIX = ".snapshot-"
TEMP_SUFFIX = ".tmp"

_LENGTH = struct.Struct(">I")
_PREFIX_BYTES = len(MAGIC) + _LENGTH.size
# Real headers are a few hundred bytes; the cap stops garbage lengths from
# allocating gigabytes before we notice the file is bad.
MAX_HEADER_BYTES = 1 << 20
_CHUNK_BYTES = 1 << 20
_SHA256_HEX_LEN = 64
_MAX_U64 = (1 << 64) - 1
_MAX_U32 = (1 << 32) - 1
_NAME_RE = re.compile(r"^snapshot-(\d{12,})-(\d{12,})\.snap$")


class SnapshotError(Exception):
    """A snapshot file cannot be used; ``reason`` says why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"snapshot {self.path}: {reason}")


class CorruptSnapshotError(SnapshotError):
    """The file is damaged (bad magic, header, size or checksum) or unreadable by this build."""


class UnsupportedSnapshotVersionError(CorruptSnapshotError):
    """The header is intact but has a format version this build does not know.

    A subclass of :class:`CorruptSnapshotError` so callers treat it as unusable,
    but the file is probably fine for a newer build (kept, not quarantined).
    """


class NewerSnapshotVersionError(UnsupportedSnapshotVersionError):
    """Written by a newer release (file layout or state body): a broker that finds one
    where it boots must stop and be upgraded, not boot from something older."""


class ForeignSnapshotError(SnapshotError):
    """An intact snapshot of a different cluster."""


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    format_version: int
    cluster_id: str
    # Position the state reflects: the last applied log entry.
    ledger_id: int
    entry_id: int
    created_ms: int
    body_size_bytes: int  # uncompressed
    compressed_size_bytes: int  # as stored after the header
    checksum: str  # hex SHA-256 of the compressed body bytes
    # State digest reported by the state machine; opaque, for operators.
    digest: str

    @property
    def position(self) -> tuple[int, int]:
        return (self.ledger_id, self.entry_id)


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    path: Path
    header: SnapshotHeader

    @property
    def position(self) -> tuple[int, int]:
        return self.header.position


class _VersionProbe(msgspec.Struct):
    """Decoded first, so a future layout is reported as a version problem, not garbage."""

    format_version: int


class _CrcProbe(msgspec.Struct):
    header_crc32: int


def snapshot_file_name(ledger_id: int, entry_id: int) -> str:
    return f"snapshot-{ledger_id:012d}-{entry_id:012d}.snap"


def parse_snapshot_file_name(name: str) -> tuple[int, int] | None:
    """The (ledger_id, entry_id) in a final snapshot file name, or None for other names."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return (int(match.group(1)), int(match.group(2)))


def _header_crc32(header: SnapshotHeader) -> int:
    return zlib.crc32(msgspec.msgpack.encode(asdict(header)))


def _encode_header(header: SnapshotHeader, *, crc32: int, pad_bytes: int) -> bytes:
    fields: dict[str, object] = asdict(header)
    fields["header_crc32"] = crc32
    fields["pad"] = b"\0" * pad_bytes
    return msgspec.msgpack.encode(fields)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """File wrapper the zstd stream writer writes into: hashes and counts on the way."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size_bytes = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size_bytes += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


class _HashingReader:
    """File wrapper the zstd stream reader reads from: hashes everything read."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self.sha256.update(data)
        self.size_bytes += len(data)
        return data

    def drain(self) -> None:
        """Hash what the decompressor left unread (trailing bytes or after an error)."""
        while self.read(_CHUNK_BYTES):
            pass


def write_snapshot(
    directory: str | os.PathLike[str],
    *,
    cluster_id: str,
    ledger_id: int,
    entry_id: int,
    digest: str,
    body: bytes | memoryview,
    created_ms: int | None = None,
    level: int = DEFAULT_COMPRESSION_LEVEL,
    threads: int = 0,
) -> SnapshotInfo:
    """Write ``body`` as the snapshot at (ledger_id, entry_id) into ``directory``, durably.

    The body is compressed in a streaming way straight into the file (memory
    stays around the body's own size, however large). ``threads`` goes to
    zstd: 0 compresses on the calling thread, -1 uses one worker per CPU.
    Replaces an existing snapshot at the same position. Returns the final
    path and header.
    """
    if ledger_id < 0 or entry_id < 0:
        # A state that reflects no entry of ledger L is the state at the end of the
        # previous ledger: snapshot it at that position instead.
        raise ValueError(f"position must be non-negative, got ({ledger_id}, {entry_id})")
    directory = Path(directory)
    view = memoryview(body).cast("B")  # byte view so len() is bytes for any buffer format
    body_size_bytes = view.nbytes
    if created_ms is None:
        created_ms = int(time.time() * 1000)
    placeholder = SnapshotHeader(
        format_version=FORMAT_VERSION,
        cluster_id=cluster_id,
        ledger_id=ledger_id,
        entry_id=entry_id,
        created_ms=created_ms,
        body_size_bytes=body_size_bytes,
        compressed_size_bytes=_MAX_U64,
        checksum="0" * _SHA256_HEX_LEN,
        digest=digest,
    )
    reserved = _encode_header(placeholder, crc32=_MAX_U32, pad_bytes=0)
    if len(reserved) > MAX_HEADER_BYTES:
        raise ValueError(f"header too large ({len(reserved)} bytes): cluster_id/digest too long")

    fd, temp_name = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
    temp_path = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(MAGIC + _LENGTH.pack(len(reserved)) + reserved)
            sink = _HashingWriter(file)
            compressor = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
            # The stubs ask for IO[bytes]; zstd only calls write() and flush().
            with compressor.stream_writer(
                cast(IO[bytes], sink), size=body_size_bytes, closefd=False
            ) as writer:
                for start in range(0, body_size_bytes, _CHUNK_BYTES):
                    writer.write(view[start : start + _CHUNK_BYTES])
            header = replace(
                placeholder,
                compressed_size_bytes=sink.size_bytes,
                checksum=sink.sha256.hexdigest(),
            )
            # Real values encode no wider than the placeholders; pad makes up the difference.
            crc32 = _header_crc32(header)
            unpadded = _encode_header(header, crc32=crc32, pad_bytes=0)
            pad_bytes = len(reserved) - len(unpadded)
            encoded = _encode_header(header, crc32=crc32, pad_bytes=pad_bytes)
            if len(encoded) != len(reserved):
                raise AssertionError(f"header length {len(encoded)} != reserved {len(reserved)}")
            file.seek(_PREFIX_BYTES)
            file.write(encoded)
            file.flush()
            os.fsync(file.fileno())
        final_path = directory / snapshot_file_name(ledger_id, entry_id)
        os.replace(temp_path, final_path)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return SnapshotInfo(final_path, header)


def _read_exact(file: BinaryIO, size: int) -> bytes | None:
    data = file.read(size)
    return data if len(data) == size else None


def _read_header_from(file: BinaryIO, path: Path) -> SnapshotHeader:
    """Parse and check the header; leaves ``file`` positioned at the body."""
    file_size = os.fstat(file.fileno()).st_size
    if file_size == 0:
        raise CorruptSnapshotError(path, "file is empty")
    magic = _read_exact(file, len(MAGIC))
    if magic is None:
        raise CorruptSnapshotError(path, f"truncated: {file_size} bytes, shorter than the magic")
    if magic != MAGIC:
        raise CorruptSnapshotError(path, f"bad magic {magic!r} (expected {MAGIC!r})")
    length_bytes = _read_exact(file, _LENGTH.size)
    if length_bytes is None:
        raise CorruptSnapshotError(path, f"truncated: {file_size} bytes, no header length")
    (header_len,) = _LENGTH.unpack(length_bytes)
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise CorruptSnapshotError(path, f"implausible header length {header_len}")
    raw = _read_exact(file, header_len)
    if raw is None:
        raise CorruptSnapshotError(
            path, f"truncated: {file_size} bytes, header of {header_len} bytes does not fit"
        )
    try:
        version = msgspec.msgpack.decode(raw, type=_VersionProbe).format_version
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise CorruptSnapshotError(path, f"undecodable header: {exc}") from exc
    if version > FORMAT_VERSION:
        raise NewerSnapshotVersionError(
            path,
            f"format version {version} is newer than this broker's {FORMAT_VERSION}: "
            f"upgrade the broker to a release that reads snapshot format {version}",
        )
    if version != FORMAT_VERSION:
        raise UnsupportedSnapshotVersionError(
            path, f"unsupported format version {version} (this build reads {FORMAT_VERSION})"
        )
    try:
        header = msgspec.msgpack.decode(raw, type=SnapshotHeader)
        stored_crc32 = msgspec.msgpack.decode(raw, type=_CrcProbe).header_crc32
    except msgspec.DecodeError as exc:
        raise CorruptSnapshotError(path, f"invalid header: {exc}") from exc
    actual_crc32 = _header_crc32(header)
    if stored_crc32 != actual_crc32:
        raise CorruptSnapshotError(
            path,
            f"header checksum mismatch: stored crc32 {stored_crc32:#010x}, "
            f"fields hash to {actual_crc32:#010x}",
        )
    _check_header_values(header, path)
    expected_size = _PREFIX_BYTES + header_len + header.compressed_size_bytes
    if file_size < expected_size:
        raise CorruptSnapshotError(
            path, f"truncated: file is {file_size} bytes, header says {expected_size}"
        )
    if file_size > expected_size:
        raise CorruptSnapshotError(
            path, f"trailing bytes: file is {file_size} bytes, header says {expected_size}"
        )
    return header


def _check_header_values(header: SnapshotHeader, path: Path) -> None:
    for name in ("ledger_id", "entry_id", "body_size_bytes", "compressed_size_bytes"):
        if getattr(header, name) < 0:
            raise CorruptSnapshotError(path, f"invalid header: negative {name}")
    checksum = header.checksum
    if len(checksum) != _SHA256_HEX_LEN or checksum.strip("0123456789abcdef"):
        raise CorruptSnapshotError(path, f"invalid header: checksum {checksum!r} is not sha256 hex")


def _checksum_mismatch(path: Path, header: SnapshotHeader, actual: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(
        path, f"checksum mismatch: header says {header.checksum}, body hashes to {actual}"
    )


def read_header(path: str | os.PathLike[str]) -> SnapshotHeader:
    """Read and check only the header (magic, version, fields, file size). Cheap.

    Raises :class:`CorruptSnapshotError` (or its subclass
    :class:`UnsupportedSnapshotVersionError`); OSError for IO failures.
    """
    path = Path(path)
    with path.open("rb") as file:
        return _read_header_from(file, path)


def read_snapshot(path: str | os.PathLike[str]) -> tuple[SnapshotHeader, bytes]:
    """Read, fully verify and decompress a snapshot file at any path.

    Verifies magic, header, format version, sizes and checksum (before
    decompressing). Raises :class:`CorruptSnapshotError` with the reason;
    OSError for IO failures.
    """
    path = Path(path)
    with path.open("rb") as file:
        header = _read_header_from(file, path)
        compressed = _read_exact(file, header.compressed_size_bytes)
    if compressed is None:  # shrank after the size check
        raise CorruptSnapshotError(path, "truncated while reading the body")
    actual = hashlib.sha256(compressed).hexdigest()
    if actual != header.checksum:
        raise _checksum_mismatch(path, header, actual)
    # Check the frame's declared size before decompress() allocates it.
    try:
        frame_size = zstandard.frame_content_size(compressed)
    except zstandard.ZstdError as exc:
        raise CorruptSnapshotError(path, f"bad zstd frame: {exc}") from exc
    if frame_size != header.body_size_bytes:
        raise CorruptSnapshotError(
            path,
            f"size mismatch: header says {header.body_size_bytes} body bytes, "
            f"zstd frame says {frame_size}",
        )
    try:
        body = zstandard.ZstdDecompressor().decompress(compressed)
    except zstandard.ZstdError as exc:
        raise CorruptSnapshotError(path, f"decompression failed: {exc}") from exc
    del compressed
    if len(body) != header.body_size_bytes:
        raise CorruptSnapshotError(
            path,
            f"size mismatch: header says {header.body_size_bytes} body bytes, got {len(body)}",
        )
    return header, body


def verify_snapshot_file(path: str | os.PathLike[str]) -> SnapshotHeader:
    """Fully verify a snapshot file at any path (e.g. a download) without keeping the body.

    Same checks as :func:`read_snapshot`, including decompressing, but streams
    with bounded memory. Returns the header; raises :class:`CorruptSnapshotError`.
    """
    path = Path(path)
    with path.open("rb") as file:
        header = _read_header_from(file, path)
        source = _HashingReader(file)
        body_size_bytes = 0
        zstd_error: zstandard.ZstdError | None = None
        try:
            # The stubs ask for IO[bytes]; zstd only calls read().
            with zstandard.ZstdDecompressor().stream_reader(
                cast(IO[bytes], source), read_size=_CHUNK_BYTES, closefd=False
            ) as reader:
                while chunk := reader.read(_CHUNK_BYTES):
                    body_size_bytes += len(chunk)
                    if body_size_bytes > header.body_size_bytes:
                        break  # no need to inflate a bad body any further
        except zstandard.ZstdError as exc:
            zstd_error = exc
        source.drain()
    # Checksum first: a damaged body usually also upsets zstd, and the checksum
    # is the clearer reason.
    actual = source.sha256.hexdigest()
    if source.size_bytes != header.compressed_size_bytes:
        raise CorruptSnapshotError(path, "file changed size while being verified")
    if actual != header.checksum:
        raise _checksum_mismatch(path, header, actual)
    if zstd_error is not None:
        raise CorruptSnapshotError(path, f"decompression failed: {zstd_error}")
    if body_size_bytes != header.body_size_bytes:
        raise CorruptSnapshotError(
            path,
            f"size mismatch: header says {header.body_size_bytes} body bytes, "
            f"decompressed {body_size_bytes}"
            + (" or more" if body_size_bytes > header.body_size_bytes else ""),
        )
    return header


def install_snapshot_file(
    store_dir: str | os.PathLike[str],
    downloaded_path: str | os.PathLike[str],
    *,
    expected_cluster_id: str | None = None,
) -> SnapshotInfo:
    """Verify a snapshot file (e.g. downloaded from a peer) and move it into ``store_dir``.

    ``store_dir`` must exist. On success the file is gone from
    ``downloaded_path`` and durable under its canonical name (replacing one at
    the same position). When verification fails (:class:`CorruptSnapshotError`,
    or :class:`ForeignSnapshotError` when ``expected_cluster_id`` is given and
    differs) the downloaded file is left as is.
    """
    store_dir = Path(store_dir)
    source = Path(downloaded_path)
    header = verify_snapshot_file(source)
    if expected_cluster_id is not None and header.cluster_id != expected_cluster_id:
        raise ForeignSnapshotError(
            source,
            f"belongs to cluster {header.cluster_id!r}, not {expected_cluster_id!r}",
        )
    fd, temp_name = tempfile.mkstemp(dir=store_dir, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
    os.close(fd)
    temp_path = Path(temp_name)
    final_path = store_dir / snapshot_file_name(header.ledger_id, header.entry_id)
    copied = False
    try:
        try:
            os.replace(source, temp_path)  # same filesystem: no copy
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with source.open("rb") as src, temp_path.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK_BYTES)
            copied = True
        # The downloader may not have fsynced; the rename must not outrun the data.
        with temp_path.open("rb+") as file:
            os.fsync(file.fileno())
        os.replace(temp_path, final_path)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    _fsync_dir(store_dir)
    if copied:
        source.unlink(missing_ok=True)
    return SnapshotInfo(final_path, header)
