"""Code artifacts on a broker's disk, content-addressed by sha256 (docs/DESIGN.md §7).

An upload is checked (:func:`validate_upload`) without parsing anything unbounded in
the broker: the name, the size bounds and a zip's entry count here, the ``.py``
compile and the zip's streamed inflation in a child process with an address-space,
CPU and wall-clock limit (``broker/artifacts/artifact_check.py``). A stored file is hashed again
before its first use by a process (:meth:`CodeStore.verify`), so a file damaged or
changed while the broker was down is dropped (and fetched again from a peer), not served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Container
from pathlib import Path
from typing import Final

from broker.artifacts.artifact_check import (
    ArtifactLimits,
    ArtifactTooLargeError,
    InvalidArtifactError,
    count_zip_entries,
    limits_json,
)
from broker.core import entries as e
from broker.core.entries import SHA256_RE
from log.private_fs import make_private_dirs

__all__ = [
    "ARTIFACT_SUFFIXES",
    "SHA256_RE",
    "ArtifactLimits",
    "ArtifactTooLargeError",
    "CodeStore",
    "InvalidArtifactError",
    "UploadChecker",
    "check_artifact_name",
    "code_deleted",
]

logger = logging.getLogger(__name__)

ARTIFACT_SUFFIXES: Final = (".py", ".zip", ".whl")
_CHECK_SCRIPT: Final = str(Path(__file__).with_name("artifact_check.py"))
_CHUNK_BYTES: Final = 1024 * 1024
#: The check process's answer is one short JSON line; more is a broken check.
_MAX_ANSWER_BYTES: Final = 64 * 1024


def check_artifact_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}", name):
        raise InvalidArtifactError("name must be a plain file name (letters, digits, . _ + -)")
    if not name.endswith(ARTIFACT_SUFFIXES):
        raise InvalidArtifactError(f"name must end with one of {', '.join(ARTIFACT_SUFFIXES)}")


class UploadChecker:
    """Checks uploads, at most ``max_concurrent`` check processes at a time."""

    def __init__(self, limits: ArtifactLimits | None = None, max_concurrent: int = 2) -> None:
        self.limits = limits or ArtifactLimits()
        self._slots = asyncio.Semaphore(max_concurrent)

    async def check(self, name: str, data: bytes) -> None:
        """Raise :class:`InvalidArtifactError` (:class:`ArtifactTooLargeError` for a
        bound) unless ``data`` is a usable artifact called ``name``."""
        check_artifact_name(name)
        if not data:
            raise InvalidArtifactError("the artifact is empty")
        limits = self.limits
        if name.endswith(".py"):
            if len(data) > limits.max_py_bytes:
                raise ArtifactTooLargeError(
                    f"{name} is {len(data)} bytes; a .py artifact may have"
                    f" {limits.max_py_bytes} (ship larger code as a .zip or wheel)"
                )
            kind = "py"
        else:
            # Cheap and bounded (a few bytes per entry, at most max_zip_entries + 1):
            # refuses an archive of too many entries before any process is started.
            count_zip_entries(io.BytesIO(data), limits, name)
            kind = "zip"
        async with self._slots:
            await self._run_check(kind, name, data)

    async def _run_check(self, kind: str, name: str, data: bytes) -> None:
        limits = self.limits
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # no PYTHON* variables, no user site, not the current directory
            "-S",  # standard library only
            "-B",
            _CHECK_SCRIPT,
            kind,
            name,
            limits_json(limits),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env={},
        )
        try:
            async with asyncio.timeout(limits.check_timeout_s):
                answer, _ = await process.communicate(data)
        except TimeoutError:
            raise InvalidArtifactError(
                f"{name} could not be checked within {limits.check_timeout_s} s;"
                " make it smaller or simpler"
            ) from None
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        try:
            result = json.loads(answer[:_MAX_ANSWER_BYTES])
        except ValueError:
            result = None
        if not isinstance(result, dict):
            # Killed by its limits (e.g. RLIMIT_CPU) before it could answer.
            raise InvalidArtifactError(
                f"{name} could not be checked within the broker's limits"
                f" (check process exit status {process.returncode}); make it smaller or simpler"
            )
        if result.get("ok") is True:
            return
        message = str(result.get("error") or "invalid artifact")
        if result.get("too_large"):
            raise ArtifactTooLargeError(message)
        raise InvalidArtifactError(message)


class CodeStore:
    """Artifact files named by their sha256 in one directory (0700; files 0600)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        make_private_dirs(directory)
        # Files hashed (or written) by this process: trusted until the process ends.
        self._verified: set[str] = set()
        self._lock = threading.Lock()

    def path(self, sha256: str) -> Path:
        if not SHA256_RE.fullmatch(sha256):
            raise ValueError("not a sha256")
        return self.directory / sha256

    def has(self, sha256: str) -> bool:
        """The file is present (not hashed: see :meth:`verify`)."""
        return SHA256_RE.fullmatch(sha256) is not None and self.path(sha256).exists()

    def verify(self, sha256: str) -> bool:
        """True when the stored file hashes to its name. Hashed once per process; a file
        that does not match is removed (a peer or an upload brings it again). Blocking."""
        with self._lock:
            if sha256 in self._verified:
                return self.has(sha256)
        path = self.path(sha256)
        try:
            actual = _file_sha256(path)
        except FileNotFoundError:
            return False
        if actual != sha256:
            self._drop(sha256, actual)
            return False
        with self._lock:
            self._verified.add(sha256)
        return True

    def put(self, data: bytes) -> str:
        """Store ``data`` durably (temp file, fsync, rename); returns its sha256."""
        sha256 = hashlib.sha256(data).hexdigest()
        final = self.path(sha256)
        # Written again even when present: skipping the write would let an upload's
        # latency tell a tenant that another tenant uploaded the same bytes.
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=".upload-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, final)
        except BaseException:
            with_suppressed_unlink(temp)
            raise
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        with self._lock:
            self._verified.add(sha256)
        return sha256

    def read(self, sha256: str) -> bytes:
        """The artifact's bytes, hashed on every read; FileNotFoundError when missing or
        damaged (then also removed, so that the replicator fetches it again)."""
        data = self.path(sha256).read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            with self._lock:
                self._verified.discard(sha256)
            self._drop(sha256, actual)
            raise FileNotFoundError(f"code artifact {sha256} is damaged on this broker")
        with self._lock:
            self._verified.add(sha256)
        return data

    def remove(self, sha256: str, written_before_ms: int | None = None) -> bool:
        """Remove an artifact's file; True when one was removed. With ``written_before_ms``
        a file written at or after that time is kept: an upload of the same bytes that
        raced a delete (stored, its AddCode not yet applied) must not lose its file."""
        path = self.path(sha256)
        try:
            if written_before_ms is not None and path.stat().st_mtime * 1000 >= written_before_ms:
                logger.info("code artifact %s: written again since its delete; kept", sha256)
                return False
            path.unlink()
        except FileNotFoundError:
            return False
        with self._lock:
            self._verified.discard(sha256)
        logger.info("code artifact %s removed from this broker's store", sha256)
        return True

    def remove_unknown(self, known: Container[str]) -> int:
        """Remove stored artifacts the state does not know (deleted while no listener
        ran); only where the state is complete and no upload is in flight, i.e. at a
        standalone broker's start. Blocking; returns how many were removed."""
        removed = 0
        for name in sorted(os.listdir(self.directory)):
            if SHA256_RE.fullmatch(name) and name not in known and self.remove(name):
                removed += 1
        return removed

    def on_applied(self, entry: e.Entry, applied: object = None) -> None:
        """Node apply listener: a DeleteCode that deleted the artifact removes its file
        here (on every broker: docs/DESIGN.md §7)."""
        if not isinstance(entry, e.DeleteCode):
            return
        owners = getattr(getattr(applied, "result", None), "owners", None)
        if isinstance(owners, list) and code_deleted(entry, owners):
            self.remove(entry.sha256, written_before_ms=entry.time_ms)

    def usage(self) -> tuple[int, int]:
        """(artifact count, total bytes) of the stored artifacts (blocking: a scan)."""
        count = size_bytes = 0
        try:
            with os.scandir(self.directory) as entries:
                for item in entries:
                    if SHA256_RE.fullmatch(item.name):
                        with contextlib.suppress(FileNotFoundError):
                            size_bytes += item.stat().st_size
                            count += 1
        except FileNotFoundError:
            pass
        return count, size_bytes

    def _drop(self, sha256: str, actual: str) -> None:
        logger.warning(
            "code artifact %s: the stored file hashes to %s (damaged or changed);"
            " removed, to be fetched again",
            sha256,
            actual,
        )
        with contextlib.suppress(FileNotFoundError):
            self.path(sha256).unlink()


def code_deleted(entry: e.DeleteCode, owners: list[str]) -> bool:
    """Whether an applied (not rejected) DeleteCode whose result (the artifact) has these
    ``owners`` deleted the artifact, rather than only dropping one tenant's claim on it
    (then that tenant is no longer an owner)."""
    return entry.tenant is None or entry.tenant in owners


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def with_suppressed_unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
