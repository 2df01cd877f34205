"""Local snapshot directory (docs/DESIGN.md §5): write, list, prune, load the newest valid one.

Files are named ``snapshot-<ledger_id:012d>-<entry_id:012d>.snap`` and ordered by
position (ledger_id, entry_id); ledger ids increase over time. In-progress files
are dot-prefixed temp files renamed into place only when complete, so readers
never see partial snapshots; leftovers of crashed writers are deleted on the
next write or install. Snapshots found corrupt by :meth:`SnapshotStore.load_newest`
are renamed to ``*.snap.corrupt`` (kept for operators, never retried).

One store per directory and process. All methods do blocking IO; call them
from a worker thread. Mutations (write, install, prune, load_newest's
quarantining) are serialized by a lock; ``list``/``newest`` take no lock and
tolerate files being pruned under them.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from log.private_fs import make_private_dirs
from snapshot.format import (
    DEFAULT_COMPRESSION_LEVEL,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    CorruptSnapshotError,
    ForeignSnapshotError,
    NewerSnapshotVersionError,
    SnapshotError,
    SnapshotHeader,
    SnapshotInfo,
    UnsupportedSnapshotVersionError,
    install_snapshot_file,
    parse_snapshot_file_name,
    read_header,
    read_snapshot,
    write_snapshot,
)

__all__ = ["CORRUPT_SUFFIX", "SnapshotStore"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

CORRUPT_SUFFIX = ".corrupt"


class SnapshotStore:
    """The snapshots of one broker, newest position first, keeping the newest ``keep``.

    With ``cluster_id`` set, snapshots of other clusters are never listed,
    loaded or installed, and :meth:`write` defaults to that cluster id.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 3,
        *,
        cluster_id: str | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._directory = Path(directory)
        self._keep = keep
        self._cluster_id = cluster_id
        self._lock = threading.Lock()
        make_private_dirs(self._directory)  # 0700: snapshots hold every tenant's state

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def keep(self) -> int:
        return self._keep

    def list(self) -> builtins.list[SnapshotInfo]:
        """Snapshots whose header reads fine, newest position first.

        Checks headers only (not checksums). Unusable files are skipped with a
        WARNING naming the file and the reason.
        """
        # A writer may prune files between the scan and the header reads; when a
        # file vanished, scan again (a few times) so a newer one is not missed.
        for _ in range(5):
            infos: builtins.list[SnapshotInfo] = []
            vanished = False
            for position, path in self._scan():
                try:
                    header = read_header(path)
                    self._check_identity(path, position, header)
                except FileNotFoundError:
                    vanished = True
                    continue
                except SnapshotError as exc:
                    logger.warning("snapshot %s skipped: %s", path, exc.reason)
                    continue
                except OSError as exc:
                    logger.warning("snapshot %s skipped: cannot read header: %s", path, exc)
                    continue
                infos.append(SnapshotInfo(path, header))
            if not vanished:
                break
        return infos

    def newest(self) -> SnapshotInfo | None:
        """The newest snapshot with a good header (body not verified), or None."""
        infos = self.list()
        return infos[0] if infos else None

    def newest_path(self) -> Path | None:
        """Path of the newest snapshot, e.g. to serve it to a peer.

        The file may be pruned right after this returns; open it promptly (an
        open file stays readable after it is deleted).
        """
        info = self.newest()
        return info.path if info is not None else None

    def write(
        self,
        *,
        ledger_id: int,
        entry_id: int,
        digest: str,
        body: bytes | memoryview,
        cluster_id: str | None = None,
        created_ms: int | None = None,
        level: int = DEFAULT_COMPRESSION_LEVEL,
        threads: int = 0,
    ) -> SnapshotInfo:
        """Durably write a snapshot (see :func:`snapshot.format.write_snapshot`), then prune.

        If the new snapshot is older than ``keep`` existing ones it is pruned
        right away (the returned path then no longer exists).
        """
        cluster_id = self._resolve_cluster_id(cluster_id)
        with self._lock:
            self._remove_stale_temp_files()
            info = write_snapshot(
                self._directory,
                cluster_id=cluster_id,
                ledger_id=ledger_id,
                entry_id=entry_id,
                digest=digest,
                body=body,
                created_ms=created_ms,
                level=level,
                threads=threads,
            )
            self._prune()
        return info

    def install(self, downloaded_path: str | os.PathLike[str]) -> SnapshotInfo:
        """Verify a downloaded snapshot file and move it into the store, then prune.

        Raises :class:`CorruptSnapshotError` or :class:`ForeignSnapshotError`
        (the downloaded file is then left in place).
        """
        with self._lock:
            self._remove_stale_temp_files()
            info = install_snapshot_file(
                self._directory, downloaded_path, expected_cluster_id=self._cluster_id
            )
            self._prune()
        return info

    def load_newest_decoded(
        self, decode: Callable[[bytes], _T], *, refuse_newer: bool = False
    ) -> tuple[SnapshotHeader, _T] | None:
        """Like :meth:`load_newest`, but also skips snapshots whose verified body
        ``decode`` rejects (e.g. a state format this build cannot read); those
        are logged and kept, never loaded.

        ``refuse_newer``: a snapshot written by a newer release (its header, or ``decode``
        raising :class:`NewerSnapshotVersionError`) met before a usable one raises
        :class:`NewerSnapshotVersionError` naming the file instead of being skipped."""
        with self._lock:
            skipped: set[Path] = set()
            while True:
                found = self._load_newest_locked(skipped, refuse_newer=refuse_newer)
                if found is None:
                    return None
                path, header, body = found
                try:
                    return header, decode(body)
                except NewerSnapshotVersionError as exc:
                    if refuse_newer:
                        raise NewerSnapshotVersionError(path, exc.reason) from exc
                    logger.warning("snapshot %s cannot be decoded: %s; skipping", path, exc)
                    skipped.add(path)
                except Exception as exc:
                    logger.warning("snapshot %s cannot be decoded: %s; skipping", path, exc)
                    skipped.add(path)

    def load_newest(self) -> tuple[SnapshotHeader, bytes] | None:
        """The newest fully verified snapshot, or None when there is no valid one.

        Tries snapshots newest first. A corrupt one is logged at WARNING, never
        returned, and renamed to ``*.corrupt`` so it is not tried again. One of
        an unknown format version or another cluster is skipped but kept.
        """
        # Held throughout so a concurrent write cannot prune the files being tried.
        with self._lock:
            found = self._load_newest_locked(set())
        return None if found is None else (found[1], found[2])

    def _load_newest_locked(
        self, skipped: set[Path], *, refuse_newer: bool = False
    ) -> tuple[Path, SnapshotHeader, bytes] | None:
        for position, path in self._scan():
            if path in skipped:
                continue
            try:
                header, body = read_snapshot(path)
                self._check_identity(path, position, header)
            except FileNotFoundError:
                continue
            except (UnsupportedSnapshotVersionError, ForeignSnapshotError) as exc:
                if refuse_newer and isinstance(exc, NewerSnapshotVersionError):
                    raise
                logger.warning("snapshot %s is unusable: %s; skipping", path, exc.reason)
                continue
            except CorruptSnapshotError as exc:
                logger.warning("snapshot %s is corrupt: %s; skipping", path, exc.reason)
                self._quarantine(path)
                continue
            except OSError as exc:
                # Possibly transient (EIO, permissions): skip without quarantining.
                logger.warning("snapshot %s could not be read: %s; skipping", path, exc)
                continue
            return path, header, body
        return None

    def prune(self) -> None:
        """Delete snapshots older than the newest ``keep`` ones with a good header."""
        with self._lock:
            self._prune()

    def remove_stale_temp_files(self) -> None:
        """Delete temp files left by interrupted writes or installs."""
        with self._lock:
            self._remove_stale_temp_files()

    # -- internals (callers hold the lock where it matters) --

    def _resolve_cluster_id(self, cluster_id: str | None) -> str:
        if cluster_id is None:
            if self._cluster_id is None:
                raise ValueError("cluster_id is required (the store has none configured)")
            return self._cluster_id
        if self._cluster_id is not None and cluster_id != self._cluster_id:
            raise ValueError(f"cluster_id {cluster_id!r} != store's {self._cluster_id!r}")
        return cluster_id

    def _scan(self) -> builtins.list[tuple[tuple[int, int], Path]]:
        """Final snapshot files by the position in their name, newest first."""
        found: builtins.list[tuple[tuple[int, int], Path]] = []
        with os.scandir(self._directory) as entries:
            for entry in entries:
                position = parse_snapshot_file_name(entry.name)
                if position is not None:
                    found.append((position, Path(entry.path)))
        found.sort(reverse=True)
        return found

    def _check_identity(
        self, path: Path, position: tuple[int, int], header: SnapshotHeader
    ) -> None:
        if header.position != position:
            # Ordering and pruning go by name, so a name that lies cannot be trusted.
            raise CorruptSnapshotError(
                path, f"file name says position {position} but header says {header.position}"
            )
        if self._cluster_id is not None and header.cluster_id != self._cluster_id:
            raise ForeignSnapshotError(
                path, f"belongs to cluster {header.cluster_id!r}, not {self._cluster_id!r}"
            )

    def _quarantine(self, path: Path) -> None:
        target = path.with_name(path.name + CORRUPT_SUFFIX)
        try:
            os.replace(path, target)
        except OSError as exc:
            logger.warning("could not rename corrupt snapshot %s: %s", path, exc)

    def _prune(self) -> None:
        infos = self.list()
        if len(infos) <= self._keep:
            return
        oldest_kept = infos[self._keep - 1].position
        # By name, so older files with unreadable headers go too.
        for position, path in self._scan():
            if position < oldest_kept:
                try:
                    path.unlink(missing_ok=True)
                    logger.debug("pruned snapshot %s", path)
                except OSError as exc:
                    logger.warning("could not delete old snapshot %s: %s", path, exc)

    def _remove_stale_temp_files(self) -> None:
        with os.scandir(self._directory) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(TEMP_SUFFIX):
                    try:
                        os.unlink(entry.path)
                        logger.info("removed stale snapshot temp file %s", entry.path)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        logger.warning("could not remove temp file %s: %s", entry.path, exc)
