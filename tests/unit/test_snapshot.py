"""Snapshot format and local store (snapshot/format.py, snapshot/store.py)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import struct
import threading
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from snapshot.format import (
    FORMAT_VERSION,
    MAGIC,
    CorruptSnapshotError,
    ForeignSnapshotError,
    SnapshotHeader,
    UnsupportedSnapshotVersionError,
    install_snapshot_file,
    read_header,
    read_snapshot,
    snapshot_file_name,
    verify_snapshot_file,
    write_snapshot,
)
from snapshot.store import SnapshotStore

CLUSTER = "cluster-a"
STORE_LOGGER = "snapshot.store"


def _body(size_bytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size_bytes)


def _write(
    directory: Path, ledger_id: int, entry_id: int, body: bytes | memoryview, **kwargs: Any
) -> Path:
    info = write_snapshot(
        directory,
        cluster_id=kwargs.pop("cluster_id", CLUSTER),
        ledger_id=ledger_id,
        entry_id=entry_id,
        digest=f"digest-{ledger_id}-{entry_id}",
        body=body,
        **kwargs,
    )
    return info.path


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    """The header as a raw dict and the compressed body of a well-formed file."""
    data = path.read_bytes()
    (header_len,) = struct.unpack(">I", data[8:12])
    raw = msgspec.msgpack.decode(data[12 : 12 + header_len])
    assert isinstance(raw, dict)
    return raw, data[12 + header_len :]


def _join(path: Path, header: dict[str, Any], compressed: bytes, *, fix_crc: bool) -> None:
    """Write a file from parts; ``fix_crc`` makes the header CRC match edited fields."""
    if fix_crc:
        fields = {name: header[name] for name in SnapshotHeader.__dataclass_fields__}
        header["header_crc32"] = zlib.crc32(msgspec.msgpack.encode(fields))
    encoded = msgspec.msgpack.encode(header)
    path.write_bytes(MAGIC + struct.pack(">I", len(encoded)) + encoded + compressed)


# -- corruptions: each mutates a valid file in place --------------------------------


def _flip_body_byte(path: Path) -> None:
    _, compressed = _split(path)
    data = bytearray(path.read_bytes())
    data[len(data) - len(compressed) // 2 - 1] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_header_field(path: Path) -> None:
    header, compressed = _split(path)
    header["entry_id"] += 1
    _join(path, header, compressed, fix_crc=False)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _truncate_in_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _bad_magic(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"NOTASNAP" + data[8:])


def _unknown_version(path: Path) -> None:
    header, compressed = _split(path)
    header["format_version"] = 99
    _join(path, header, compressed, fix_crc=True)


def _header_garbage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack(">I", data[8:12])
    data[12 : 12 + header_len] = b"\xc1" * header_len  # 0xc1: never used in msgpack
    path.write_bytes(bytes(data))


def _header_missing_field(path: Path) -> None:
    header, compressed = _split(path)
    del header["checksum"]
    _join(path, header, compressed, fix_crc=False)


def _huge_header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack(">I", 0xFFFFFFFF)
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _trailing_bytes(path: Path) -> None:
    with path.open("ab") as file:
        file.write(b"extra")


def _consistent_but_wrong_size(path: Path) -> None:
    # Header checksum matches the body, but body_size_bytes lies.
    header, compressed = _split(path)
    header["body_size_bytes"] += 1
    _join(path, header, compressed, fix_crc=True)


CORRUPTIONS: list[tuple[Callable[[Path], None], str]] = [
    (_flip_body_byte, "checksum mismatch"),
    (_flip_header_field, "header checksum mismatch"),
    (_truncate, "truncated"),
    (_truncate_in_header, "truncated"),
    (_bad_magic, "bad magic"),
    (_unknown_version, "format version 99 is newer than this broker's 1: upgrade the broker"),
    (_header_garbage, "undecodable header"),
    (_header_missing_field, "invalid header"),
    (_huge_header_length, "implausible header length"),
    (_empty, "file is empty"),
    (_trailing_bytes, "trailing bytes"),
    (_consistent_but_wrong_size, "size mismatch"),
]
CORRUPTION_IDS = [corrupt.__name__.lstrip("_") for corrupt, _ in CORRUPTIONS]


# -- format -----------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    body = b"state " * 1000
    info = write_snapshot(
        tmp_path,
        cluster_id=CLUSTER,
        ledger_id=7,
        entry_id=42,
        digest="d1g3st",
        body=body,
        created_ms=1_700_000_000_123,
    )
    assert info.path == tmp_path / "snapshot-000000000007-000000000042.snap"
    assert info.path.name == snapshot_file_name(7, 42)
    assert info.position == (7, 42)

    header, read_body = read_snapshot(info.path)
    assert read_body == body
    assert header == info.header
    assert header == SnapshotHeader(
        format_version=FORMAT_VERSION,
        cluster_id=CLUSTER,
        ledger_id=7,
        entry_id=42,
        created_ms=1_700_000_000_123,
        body_size_bytes=len(body),
        compressed_size_bytes=header.compressed_size_bytes,
        checksum=header.checksum,
        digest="d1g3st",
    )
    assert 0 < header.compressed_size_bytes < len(body)
    assert len(header.checksum) == 64
    assert read_header(info.path) == header
    assert verify_snapshot_file(info.path) == header
    assert info.path.read_bytes().startswith(MAGIC)
    assert sorted(p.name for p in tmp_path.iterdir()) == [info.path.name]  # no temp left


# Sizes whose compressed lengths need msgpack ints of every width (fixint, u8, u16,
# u32): the in-place header rewrite must pad each to the reserved length.
@pytest.mark.parametrize("size_bytes", [0, 1, 50, 150, 1000, 70_000])
def test_round_trip_sizes(tmp_path: Path, size_bytes: int) -> None:
    body = _body(size_bytes)
    path = _write(tmp_path, 1, 2, body)
    header, read_body = read_snapshot(path)
    assert read_body == body
    assert header.body_size_bytes == size_bytes
    assert verify_snapshot_file(path) == header


def test_round_trip_memoryview_and_threads(tmp_path: Path) -> None:
    body = bytearray(_body(300_000)) + bytearray(300_000)
    path = _write(tmp_path, 3, 4, memoryview(body), threads=-1, level=1)
    assert read_snapshot(path)[1] == bytes(body)


def test_large_body_round_trip(tmp_path: Path) -> None:
    # 50 MB: half incompressible, half repetitive.
    half = 25 * 1024 * 1024
    body = _body(half) + b"task-record:" * (half // 12) + b"x" * (half % 12)
    assert len(body) == 2 * half
    path = _write(tmp_path, 12, 345_678, body, threads=-1)
    header = verify_snapshot_file(path)
    assert header.body_size_bytes == len(body)
    read_header_, read_body = read_snapshot(path)
    assert read_header_ == header
    assert read_body == body


def test_write_streams_without_copying_the_body(tmp_path: Path) -> None:
    body = _body(16 * 1024 * 1024)
    tracemalloc.start()
    try:
        _write(tmp_path, 1, 1, body)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A compressed copy of (incompressible) body would be ~16 MB.
    assert peak_bytes < 4 * 1024 * 1024


@pytest.mark.parametrize(("corrupt", "reason"), CORRUPTIONS, ids=CORRUPTION_IDS)
def test_corruption_detected_with_reason(
    tmp_path: Path, corrupt: Callable[[Path], None], reason: str
) -> None:
    path = _write(tmp_path, 1, 10, _body(10_000))
    corrupt(path)
    for check in (read_snapshot, verify_snapshot_file):
        with pytest.raises(CorruptSnapshotError) as excinfo:
            check(path)
        assert reason in excinfo.value.reason
        assert excinfo.value.path == path
        assert str(path) in str(excinfo.value)


def test_unknown_version_is_its_own_error(tmp_path: Path) -> None:
    path = _write(tmp_path, 1, 10, b"x")
    _unknown_version(path)
    with pytest.raises(UnsupportedSnapshotVersionError, match="newer than this broker's 1"):
        read_header(path)


def test_write_rejects_negative_position(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        _write(tmp_path, 1, -1, b"x")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr("snapshot.format.os.fsync", failing_fsync)
    with pytest.raises(OSError, match="injected"):
        _write(tmp_path, 1, 1, b"body")
    assert list(tmp_path.iterdir()) == []


def test_same_position_is_replaced(tmp_path: Path) -> None:
    _write(tmp_path, 1, 1, b"old")
    path = _write(tmp_path, 1, 1, b"new")
    assert read_snapshot(path)[1] == b"new"
    assert len(list(tmp_path.iterdir())) == 1


# -- store ------------------------------------------------------------------------


def _store_write(store: SnapshotStore, ledger_id: int, entry_id: int, body: bytes) -> Path:
    return store.write(
        ledger_id=ledger_id, entry_id=entry_id, digest=f"d{ledger_id}.{entry_id}", body=body
    ).path


def _newest(store: SnapshotStore) -> tuple[tuple[int, int], bytes]:
    """Position and body of the snapshot ``load_newest`` loads (there must be one)."""
    loaded = store.load_newest()
    assert loaded is not None
    return loaded[0].position, loaded[1]


def test_store_write_list_load(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", keep=3, cluster_id=CLUSTER)
    assert store.list() == []
    assert store.load_newest() is None
    assert store.newest_path() is None

    _store_write(store, 1, 999, b"a")
    newest = _store_write(store, 2, 0, b"b")  # higher ledger wins over higher entry
    _store_write(store, 1, 5, b"c")
    assert [info.position for info in store.list()] == [(2, 0), (1, 999), (1, 5)]
    assert store.newest_path() == newest
    loaded = store.load_newest()
    assert loaded is not None
    header, body = loaded
    assert (header.position, body, header.digest) == ((2, 0), b"b", "d2.0")


def test_store_write_cluster_id_rules(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cluster_id is required"):
        SnapshotStore(tmp_path).write(ledger_id=1, entry_id=1, digest="", body=b"")
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    with pytest.raises(ValueError, match="cluster_id"):
        store.write(ledger_id=1, entry_id=1, digest="", body=b"", cluster_id="other")
    with pytest.raises(ValueError, match="keep"):
        SnapshotStore(tmp_path, keep=0)


def test_keep_pruning(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2, cluster_id=CLUSTER)
    for entry_id in range(5):
        _store_write(store, 1, entry_id, b"s%d" % entry_id)
    _store_write(store, 2, 0, b"t")
    assert [info.position for info in store.list()] == [(2, 0), (1, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        snapshot_file_name(1, 4),
        snapshot_file_name(2, 0),
    ]


def test_pruning_counts_only_valid_headers(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2, cluster_id=CLUSTER)
    _store_write(store, 1, 1, b"a")
    _store_write(store, 1, 2, b"b")
    _empty(tmp_path / snapshot_file_name(1, 2))  # header unreadable: does not count
    _store_write(store, 1, 3, b"c")
    # Kept: the two newest valid ones (1,3) and (1,1); the broken (1,2) lies between.
    assert [info.position for info in store.list()] == [(1, 3), (1, 1)]
    _store_write(store, 1, 4, b"d")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        snapshot_file_name(1, 3),
        snapshot_file_name(1, 4),
    ]


@pytest.mark.parametrize(("corrupt", "reason"), CORRUPTIONS, ids=CORRUPTION_IDS)
def test_load_newest_skips_corrupt(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    corrupt: Callable[[Path], None],
    reason: str,
) -> None:
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    _store_write(store, 1, 1, b"previous")
    newest = _store_write(store, 1, 2, _body(10_000))
    corrupt(newest)

    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert _newest(store) == ((1, 1), b"previous")

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert str(newest) in message
    assert reason in message
    assert message.endswith("; skipping")

    # Corrupt files are set aside for good; a newer-format one is kept as is.
    quarantined = newest.with_name(newest.name + ".corrupt")
    if corrupt is _unknown_version:
        assert newest.exists()
        assert not quarantined.exists()
    else:
        assert message.startswith(f"snapshot {newest} is corrupt: ")
        assert not newest.exists()
        assert quarantined.exists()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
            assert store.load_newest() is not None
        assert caplog.records == []  # not retried


def test_newest_corrupt_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SnapshotStore(tmp_path, keep=3, cluster_id=CLUSTER)
    _store_write(store, 3, 7, b"older")
    _store_write(store, 3, 8, b"old")
    newest = _store_write(store, 4, 0, b"newest")
    _flip_body_byte(newest)

    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert _newest(store) == ((3, 8), b"old")
    assert any(
        r.levelno == logging.WARNING
        and r.getMessage().startswith(f"snapshot {newest} is corrupt: checksum mismatch")
        and r.getMessage().endswith("; skipping")
        for r in caplog.records
    )


def test_load_newest_none_when_all_corrupt(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    _flip_body_byte(_store_write(store, 1, 1, _body(1000)))
    _empty(_store_write(store, 1, 2, b"x"))
    assert store.load_newest() is None
    assert store.newest_path() is None


def test_list_skips_unreadable_header_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    _store_write(store, 1, 1, b"good")
    bad = _store_write(store, 1, 2, b"bad")
    _bad_magic(bad)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert [info.position for info in store.list()] == [(1, 1)]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert str(bad) in record.getMessage()
    assert "bad magic" in record.getMessage()


def test_file_name_must_match_header(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    _store_write(store, 1, 1, b"real")
    renamed = tmp_path / snapshot_file_name(9, 9)
    shutil.copy(tmp_path / snapshot_file_name(1, 1), renamed)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert [info.position for info in store.list()] == [(1, 1)]
        assert _newest(store) == ((1, 1), b"real")
    assert any("file name says position (9, 9)" in r.getMessage() for r in caplog.records)


def test_other_cluster_skipped_but_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(tmp_path, 1, 1, b"ours")
    theirs = _write(tmp_path, 1, 2, b"theirs", cluster_id="cluster-b")
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert _newest(store) == ((1, 1), b"ours")
    assert theirs.exists()
    assert any("belongs to cluster 'cluster-b'" in r.getMessage() for r in caplog.records)
    # Without a configured cluster id every cluster is accepted.
    assert _newest(SnapshotStore(tmp_path)) == ((1, 2), b"theirs")


def test_temp_files_ignored_and_cleaned(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, cluster_id=CLUSTER)
    stale = tmp_path / ".snapshot-crashed1234.tmp"
    stale.write_bytes(MAGIC + b"half a snapshot")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("operator notes")

    assert store.list() == []
    assert store.load_newest() is None
    assert stale.exists()

    _store_write(store, 1, 1, b"x")
    assert not stale.exists()
    assert unrelated.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", snapshot_file_name(1, 1)]


def test_install_downloaded_copy(tmp_path: Path) -> None:
    peer = SnapshotStore(tmp_path / "peer", cluster_id=CLUSTER)
    _store_write(peer, 5, 1, b"peer state 1")
    _store_write(peer, 5, 2, b"peer state 2")
    served = peer.newest_path()
    assert served is not None

    download = tmp_path / "downloads" / "incoming.part"
    download.parent.mkdir()
    shutil.copyfile(served, download)  # what an HTTP download produces

    store = SnapshotStore(tmp_path / "local", cluster_id=CLUSTER)
    info = store.install(download)
    assert info.path == store.directory / snapshot_file_name(5, 2)
    assert not download.exists()
    loaded = store.load_newest()
    assert loaded is not None
    assert loaded[0] == info.header
    assert loaded[1] == b"peer state 2"


def test_install_rejects_corrupt_and_foreign(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "local", cluster_id=CLUSTER)
    downloads = tmp_path / "downloads"
    downloads.mkdir()

    corrupt = _write(downloads, 1, 1, _body(5000))
    _flip_body_byte(corrupt)
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        store.install(corrupt)
    assert corrupt.exists()

    foreign = _write(downloads, 1, 2, b"x", cluster_id="cluster-b")
    with pytest.raises(ForeignSnapshotError, match="cluster-b"):
        store.install(foreign)
    assert foreign.exists()
    assert list(store.directory.iterdir()) == []


def test_install_across_filesystems_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    download = _write(tmp_path, 2, 3, b"state")
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(src) == download:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr("snapshot.format.os.replace", replace)
    info = install_snapshot_file(store_dir, download)
    assert not download.exists()
    assert read_snapshot(info.path)[1] == b"state"
    assert [p.name for p in store_dir.iterdir()] == [snapshot_file_name(2, 3)]


def test_readers_never_see_partial_files(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2, cluster_id=CLUSTER)
    _store_write(store, 1, 0, _body(200_000))
    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for entry_id in range(1, 30):
                _store_write(store, 1, entry_id, _body(200_000, seed=entry_id))
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                assert len(store.list()) >= 1
                path = store.newest_path()
                assert path is not None
                # Pruned between newest_path() and open() is allowed.
                with contextlib.suppress(FileNotFoundError):
                    read_snapshot(path)
                loaded = store.load_newest()
                assert loaded is not None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert [info.position for info in store.list()] == [(1, 29), (1, 28)]
