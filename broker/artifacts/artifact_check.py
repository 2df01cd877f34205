"""Bounded checks of code artifacts, shared by the broker (uploads) and the worker (unpacking).

Standard library only: the broker runs this file as a script in a child process
(``python -I -S -B artifact_check.py``) with an address-space and CPU limit, so parsing a
hostile ``.py`` or walking a hostile archive can neither grow nor stall the broker.

Zip archives are never trusted by their headers: the central directory's records are
counted before :mod:`zipfile` parses them, and members are inflated in chunks while the
bytes actually produced are counted, stopping at the first bound crossed
(:class:`ArtifactLimits`). Nothing is ever inflated whole into memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Final

_MIB: Final = 1024 * 1024
_CHUNK_BYTES: Final = 64 * 1024
_EOCD: Final = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_EOCD_SIGNATURE: Final = b"PK\x05\x06"
_ZIP64_LOCATOR: Final = struct.Struct("<4sLQL")  # 20 bytes, just before the EOCD
_ZIP64_LOCATOR_SIGNATURE: Final = b"PK\x06\x07"
_ZIP64_EOCD: Final = struct.Struct("<4sQ2H2L4Q")  # 56 bytes, just before the locator
_ZIP64_EOCD_SIGNATURE: Final = b"PK\x06\x06"
_CD_RECORD: Final = struct.Struct("<4s4B4HL2L5H2L")  # central directory record (46 bytes)
_CD_SIGNATURE: Final = b"PK\x01\x02"
_MAX_COMMENT_BYTES: Final = 0xFFFF
_METHODS: Final = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}


@dataclass(frozen=True)
class ArtifactLimits:
    """Bounds on one code artifact, applied on upload (broker) and when unpacked (worker)."""

    #: A ``.py`` artifact's size; larger ones are refused (413).
    max_py_bytes: int = _MIB
    #: Entries (files and directories) in a ``.zip``/``.whl``.
    max_zip_entries: int = 10_000
    #: The sum of the members' inflated sizes, counted while inflating.
    max_unpacked_bytes: int = 256 * _MIB
    #: Inflated / compressed size of a member, once it is past ``ratio_free_bytes``.
    max_compression_ratio: int = 100
    #: Members smaller than this are never refused for their ratio (small files of
    #: blanks compress well and are harmless).
    ratio_free_bytes: int = _MIB
    #: The broker's check process: its address-space limit and its wall-clock limit.
    check_memory_bytes: int = 256 * _MIB
    check_timeout_s: float = 10.0


class InvalidArtifactError(ValueError):
    """The bytes are not a usable artifact (a clear message for the client)."""


class ArtifactTooLargeError(InvalidArtifactError):
    """The artifact crosses a size bound (HTTP 413)."""


def check_py_source(name: str, data: bytes, limits: ArtifactLimits) -> None:
    """Compile ``data`` (nothing runs). Unbounded in memory: call it in a limited process."""
    if len(data) > limits.max_py_bytes:
        raise ArtifactTooLargeError(
            f"{name} is {len(data)} bytes; a .py artifact may have {limits.max_py_bytes}"
            " (ship larger code as a .zip or wheel)"
        )
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArtifactError("a .py artifact must be UTF-8 text") from None
    try:
        compile(source, name, "exec", dont_inherit=True)
    except SyntaxError as exc:  # includes "too many nested parentheses"
        message = f"{name} does not parse: {exc.msg} (line {exc.lineno})"
        raise InvalidArtifactError(message) from None
    except (MemoryError, RecursionError):
        raise InvalidArtifactError(
            f"{name} is too deeply nested or too complex to compile; split it up"
        ) from None
    except ValueError as exc:  # e.g. a NUL byte in the source
        raise InvalidArtifactError(f"{name} does not parse: {exc}") from None


def count_zip_entries(file: IO[bytes], limits: ArtifactLimits, label: str) -> int:
    """The central directory's record count, walked record by record (never the header's
    count), stopping past ``max_zip_entries``. Reads a few bytes per record."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    tail_bytes = min(size, _EOCD.size + _MAX_COMMENT_BYTES)
    file.seek(size - tail_bytes)
    tail = file.read(tail_bytes)
    at = tail.rfind(_EOCD_SIGNATURE)
    if at < 0 or at + _EOCD.size > len(tail):
        raise InvalidArtifactError(f"{label} is not a valid zip archive (no end record)")
    _, disk, cd_disk, _, _, cd_size, _, _ = _EOCD.unpack_from(tail, at)
    record_at = size - tail_bytes + at
    if disk != 0 or cd_disk != 0:
        raise InvalidArtifactError(f"{label}: multi-disk zip archives are not supported")
    if record_at >= _ZIP64_LOCATOR.size + _ZIP64_EOCD.size:
        # Zip64 (as zipfile does, looked for always): its own end record sits just before
        # a locator just before the EOCD.
        file.seek(record_at - _ZIP64_LOCATOR.size)
        locator = file.read(_ZIP64_LOCATOR.size)
        if len(locator) == _ZIP64_LOCATOR.size and locator[:4] == _ZIP64_LOCATOR_SIGNATURE:
            file.seek(record_at - _ZIP64_LOCATOR.size - _ZIP64_EOCD.size)
            record = file.read(_ZIP64_EOCD.size)
            if len(record) != _ZIP64_EOCD.size or record[:4] != _ZIP64_EOCD_SIGNATURE:
                raise InvalidArtifactError(f"{label} is not a valid zip archive (zip64 record)")
            cd_size = _ZIP64_EOCD.unpack(record)[8]
            record_at -= _ZIP64_LOCATOR.size + _ZIP64_EOCD.size
    # Where zipfile looks for it too (it tolerates bytes prepended to the archive).
    position = record_at - cd_size
    if position < 0:
        raise InvalidArtifactError(f"{label} is not a valid zip archive (central directory)")
    entries = 0
    while position < record_at:
        file.seek(position)
        head = file.read(_CD_RECORD.size)
        if len(head) != _CD_RECORD.size or head[:4] != _CD_SIGNATURE:
            raise InvalidArtifactError(f"{label} is not a valid zip archive (central directory)")
        fields = _CD_RECORD.unpack(head)
        position += _CD_RECORD.size + fields[12] + fields[13] + fields[14]
        entries += 1
        if entries > limits.max_zip_entries:
            raise ArtifactTooLargeError(f"{label} has more than {limits.max_zip_entries} entries")
    return entries


def _member_path(label: str, name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if (
        not name
        or path.is_absolute()
        or ".." in path.parts
        or "\\" in name
        or "\0" in name
        or not path.parts
    ):
        raise InvalidArtifactError(f"{label}: unsafe path {name!r} in the archive")
    return path


def iter_zip_members(
    file: IO[bytes], limits: ArtifactLimits, label: str
) -> Iterator[tuple[PurePosixPath, bool, Iterator[bytes]]]:
    """Each member as (relative path, is a directory, its inflated bytes in chunks).

    Consume each member's chunks before asking for the next member. Raises
    :class:`InvalidArtifactError` (or :class:`ArtifactTooLargeError`) at the first
    problem, having inflated at most a chunk past the bound crossed.
    """
    count_zip_entries(file, limits, label)
    file.seek(0)
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError) as exc:
        raise InvalidArtifactError(f"{label} is not a valid zip archive: {exc}") from None
    with archive:
        infos = archive.infolist()
        seen: set[PurePosixPath] = set()
        declared = 0
        for info in infos:
            path = _member_path(label, info.filename)
            if path in seen:
                raise InvalidArtifactError(f"{label}: {info.filename!r} is in the archive twice")
            seen.add(path)
            if info.compress_type not in _METHODS and not info.is_dir():
                raise InvalidArtifactError(
                    f"{label}: {info.filename!r} uses compression method {info.compress_type};"
                    " use stored or deflate"
                )
            declared += info.file_size
            # Honest headers let a bomb be refused before anything is inflated.
            if declared > limits.max_unpacked_bytes:
                raise ArtifactTooLargeError(
                    f"{label} unpacks to more than {limits.max_unpacked_bytes} bytes"
                )
        unpacked = 0

        def chunks(info: zipfile.ZipInfo) -> Iterator[bytes]:
            nonlocal unpacked
            ratio = limits.max_compression_ratio
            allowed = max(limits.ratio_free_bytes, ratio * info.compress_size)
            member_bytes = 0
            try:
                with archive.open(info) as member:
                    while chunk := member.read(_CHUNK_BYTES):
                        member_bytes += len(chunk)
                        unpacked += len(chunk)
                        if unpacked > limits.max_unpacked_bytes:
                            raise ArtifactTooLargeError(
                                f"{label} unpacks to more than {limits.max_unpacked_bytes} bytes"
                            )
                        if member_bytes > allowed:
                            raise ArtifactTooLargeError(
                                f"{label}: {info.filename!r} inflates more than"
                                f" {ratio} times (a zip bomb?)"
                            )
                        yield chunk
            except InvalidArtifactError:
                raise
            except (
                zipfile.BadZipFile,
                zlib.error,
                EOFError,
                NotImplementedError,
                RuntimeError,  # encrypted
                ValueError,
            ) as exc:
                raise InvalidArtifactError(
                    f"{label} is not a valid zip archive: {info.filename!r}: {exc}"
                ) from None

        for info in infos:
            path = _member_path(label, info.filename)
            if info.is_dir():
                yield path, True, iter(())
            else:
                yield path, False, chunks(info)


def check_zip(file: IO[bytes], limits: ArtifactLimits, label: str) -> None:
    """Inflate every member in chunks, counting; raise at the first problem."""
    for _, _, chunks in iter_zip_members(file, limits, label):
        for _ in chunks:
            pass


def write_private_file(path: Path, chunks: Iterator[bytes]) -> None:
    """Create ``path`` (new, mode 0600 whatever the umask, no symlink followed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _limit_self(limits: ArtifactLimits) -> None:
    memory = limits.check_memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu_s = int(limits.check_timeout_s) + 1  # a backstop to the parent's wall clock
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main(argv: list[str]) -> int:
    """The check process: ``KIND NAME LIMITS_JSON``, the artifact on stdin; one JSON line out.

    The answer is ``{"ok": true}`` or ``{"error": message, "too_large": bool}``.
    """
    kind, name, limits_json = argv
    limits = ArtifactLimits(**json.loads(limits_json))
    _limit_self(limits)
    answer: dict[str, object] = {"ok": True}
    try:
        data = sys.stdin.buffer.read()
        if kind == "py":
            check_py_source(name, data, limits)
        else:
            check_zip(io.BytesIO(data), limits, name)
    except InvalidArtifactError as exc:
        answer = {"error": str(exc), "too_large": isinstance(exc, ArtifactTooLargeError)}
    except MemoryError:
        answer = {
            "error": f"{name} needs more than {limits.check_memory_bytes} bytes to check",
            "too_large": True,
        }
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


def limits_json(limits: ArtifactLimits) -> str:
    return json.dumps(asdict(limits))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
