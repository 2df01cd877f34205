"""Snapshots of the state machine (docs/DESIGN.md §5): file format and local store."""

from snapshot.format import (
    FORMAT_VERSION,
    MAGIC,
    CorruptSnapshotError,
    ForeignSnapshotError,
    NewerSnapshotVersionError,
    SnapshotError,
    SnapshotHeader,
    SnapshotInfo,
    UnsupportedSnapshotVersionError,
    install_snapshot_file,
    read_header,
    read_snapshot,
    verify_snapshot_file,
    write_snapshot,
)
from snapshot.store import SnapshotStore

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "CorruptSnapshotError",
    "ForeignSnapshotError",
    "NewerSnapshotVersionError",
    "SnapshotError",
    "SnapshotHeader",
    "SnapshotInfo",
    "SnapshotStore",
    "UnsupportedSnapshotVersionError",
    "install_snapshot_file",
    "read_header",
    "read_snapshot",
    "verify_snapshot_file",
    "write_snapshot",
]
