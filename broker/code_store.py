"""Code artifacts on a broker's disk, content-addressed by sha256 (DESIGN §7)."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Final

ARTIFACT_SUFFIXES: Final = (".py", ".zip", ".whl")
#: An artifact's name: the sha256 of its bytes as 64 lowercase hex digits (use fullmatch).
SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")


class InvalidArtifactError(ValueError):
    """The uploaded bytes are not a usable artifact (a clear message for the client)."""


def validate_artifact(name: str, data: bytes) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}", name):
        raise InvalidArtifactError("name must be a plain file name (letters, digits, . _ + -)")
    if not name.endswith(ARTIFACT_SUFFIXES):
        raise InvalidArtifactError(f"name must end with one of {', '.join(ARTIFACT_SUFFIXES)}")
    if not data:
        raise InvalidArtifactError("the artifact is empty")
    if name.endswith(".py"):
        try:
            ast.parse(data.decode("utf-8"), filename=name)
        except UnicodeDecodeError:
            raise InvalidArtifactError("a .py artifact must be UTF-8 text") from None
        except SyntaxError as exc:
            raise InvalidArtifactError(
                f"{name} does not parse: {exc.msg} (line {exc.lineno})"
            ) from None
    else:
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                bad = archive.testzip()
                names = archive.namelist()
        except zipfile.BadZipFile:
            raise InvalidArtifactError(f"{name} is not a valid zip archive") from None
        if bad is not None:
            raise InvalidArtifactError(f"{name}: member {bad} is corrupt")
        for member in names:
            if member.startswith("/") or ".." in Path(member).parts:
                raise InvalidArtifactError(f"{name}: member {member!r} escapes the archive")


class CodeStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if not SHA256_RE.fullmatch(sha256):
            raise ValueError("not a sha256")
        return self.directory / sha256

    def has(self, sha256: str) -> bool:
        return SHA256_RE.fullmatch(sha256) is not None and self.path(sha256).exists()

    def put(self, data: bytes) -> str:
        """Store ``data`` durably (temp file, fsync, rename); returns its sha256."""
        sha256 = hashlib.sha256(data).hexdigest()
        final = self.path(sha256)
        # Written again even when present: skipping the write would let an upload's
        # latency tell a tenant that another tenant uploaded the same bytes.
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=".upload-")
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
        return sha256

    def read(self, sha256: str) -> bytes:
        return self.path(sha256).read_bytes()


def with_suppressed_unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
