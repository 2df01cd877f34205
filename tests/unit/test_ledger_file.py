"""File ledger backend: framing, torn tails, group commit, IO errors, other processes."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import log.file as log_file
from log.api import (
    LedgerEntry,
    LedgerError,
    LedgerFencedError,
    LedgerList,
    NoSuchLedgerError,
)
from log.file import FRAME_HEADER, FileLedgerListStore, FileLedgerStore, encode_frame, frame_crc

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = str(Path(__file__).resolve().parents[2])
# Every wait in these tests is bounded by this.
WAIT_S = 10.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileLedgerStore]:
    store = FileLedgerStore(tmp_path)
    yield store
    await store.close()


def payload(entry_id: int) -> bytes:
    return f"entry-{entry_id:05d}".encode() * 3


async def write_ledger(directory: Path, count: int) -> tuple[int, Path]:
    store = FileLedgerStore(directory)
    writer = await store.create_ledger()
    for i in range(count):
        await writer.append(payload(i))
    await store.close()
    return writer.ledger_id, Path(store.log_path(writer.ledger_id))


def overwrite_segment(store: FileLedgerStore, ledger_id: int, data: bytes) -> None:
    Path(store.log_path(ledger_id)).write_bytes(data)


def frames_size_bytes(count: int) -> int:
    return sum(FRAME_HEADER.size + len(payload(i)) for i in range(count))


# -- format ------------------------------------------------------------------------------------


async def test_segment_holds_crc_framed_entries(tmp_path: Path) -> None:
    ledger_id, path = await write_ledger(tmp_path, 3)
    assert path.name == f"ledger-{ledger_id:012d}.log"
    assert ledger_id == 1
    raw = path.read_bytes()
    assert len(raw) == frames_size_bytes(3)
    offset = 0
    for entry_id in range(3):
        length, crc, frame_entry_id, lac = FRAME_HEADER.unpack_from(raw, offset)
        data = raw[offset + FRAME_HEADER.size : offset + FRAME_HEADER.size + length]
        assert (frame_entry_id, lac, data) == (entry_id, entry_id - 1, payload(entry_id))
        assert crc == frame_crc(entry_id, lac, data)
        offset += FRAME_HEADER.size + length
    assert raw == b"".join(encode_frame(i, i - 1, payload(i)) for i in range(3))


# -- torn and corrupt tails --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "surviving"),
    [
        ("chop_last_frame", 19),
        ("chop_last_header", 19),
        ("flip_last_payload_byte", 19),
        ("append_garbage", 20),
        ("append_zeros", 20),
    ],
)
async def test_recovery_cuts_damaged_tail(tmp_path: Path, damage: str, surviving: int) -> None:
    ledger_id, path = await write_ledger(tmp_path, 20)
    raw = bytearray(path.read_bytes())
    last_frame_size = FRAME_HEADER.size + len(payload(19))
    if damage == "chop_last_frame":
        del raw[-(last_frame_size // 2) :]
    elif damage == "chop_last_header":
        del raw[len(raw) - last_frame_size + 5 :]
    elif damage == "flip_last_payload_byte":
        raw[-3] ^= 0xFF
    elif damage == "append_garbage":
        raw += b"\xde\xad\xbe\xef" * 9
    else:
        raw += bytes(4096)  # what a crash can leave after the file size grew
    path.write_bytes(bytes(raw))
    expected = [payload(i) for i in range(surviving)]

    store = FileLedgerStore(tmp_path)
    try:
        tailing = await store.open_ledger(ledger_id, recovery=False)
        assert [e.data for e in await tailing.read(0, 100)] == expected
        assert not await tailing.wait_for_entries(surviving - 1, 0.03)
        recovered = await store.open_ledger(ledger_id, recovery=True)
        assert recovered.last_entry_id == surviving - 1
        assert [e.data for e in await recovered.read(0, 100)] == expected
        assert path.stat().st_size == frames_size_bytes(surviving)
    finally:
        await store.close()
    # Stays recovered for a later store.
    store = FileLedgerStore(tmp_path)
    try:
        again = await store.open_ledger(ledger_id, recovery=True)
        assert again.last_entry_id == surviving - 1
        assert len(await again.read(0, 100)) == surviving
    finally:
        await store.close()


async def test_entry_id_gap_ends_valid_data(store: FileLedgerStore) -> None:
    writer = await store.create_ledger()
    await writer.close()
    frames = [encode_frame(0, -1, b"a"), encode_frame(1, 0, b"b"), encode_frame(3, 1, b"d")]
    overwrite_segment(store, writer.ledger_id, b"".join(frames))
    reader = await store.open_ledger(writer.ledger_id, recovery=True)
    assert reader.last_entry_id == 1
    assert [e.data for e in await reader.read(0, 10)] == [b"a", b"b"]


async def test_corrupt_middle_frame_cuts_everything_after_it(store: FileLedgerStore) -> None:
    writer = await store.create_ledger()
    await writer.close()
    frames = [bytearray(encode_frame(i, i - 1, payload(i))) for i in range(5)]
    frames[2][-1] ^= 0x01
    overwrite_segment(store, writer.ledger_id, b"".join(frames))
    reader = await store.open_ledger(writer.ledger_id, recovery=True)
    assert reader.last_entry_id == 1


async def test_readers_honour_fence_marker_over_file_contents(tmp_path: Path) -> None:
    """A crash between writing the marker and truncating leaves bytes past the recorded
    length; no reader may return them."""
    ledger_id, path = await write_ledger(tmp_path, 5)
    store = FileLedgerStore(tmp_path)
    try:
        assert (await store.open_ledger(ledger_id, recovery=True)).last_entry_id == 4
        with path.open("ab") as segment:
            segment.write(encode_frame(5, 4, b"written past the fence"))
        tailing = await store.open_ledger(ledger_id, recovery=False)
        assert len(await tailing.read(0, 100)) == 5
        assert not await tailing.wait_for_entries(4, 0.03)
        recovered = await store.open_ledger(ledger_id, recovery=True)
        assert recovered.last_entry_id == 4
        assert len(await recovered.read(0, 100)) == 5
        assert path.stat().st_size == frames_size_bytes(5)  # re-truncated
    finally:
        await store.close()


# -- group commit and IO errors ----------------------------------------------------------------


async def test_concurrent_appends_share_fsyncs(
    store: FileLedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs = 0
    real_fdatasync = os.fdatasync

    def counting_fdatasync(fd: int) -> None:
        nonlocal fsyncs
        fsyncs += 1
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", counting_fdatasync)
    writer = await store.create_ledger()
    ids = await asyncio.gather(*(writer.append(payload(i)) for i in range(1000)))
    assert ids == list(range(1000))
    assert 1 <= fsyncs <= 10
    # The batch's LAC is what was durable when it started: nothing, for the first batch.
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    assert {e.last_add_confirmed for e in await reader.read(0, 1000)} <= set(range(-1, 999))
    assert (await reader.read(0, 1))[0].last_add_confirmed == -1


async def test_lone_append_is_flushed_without_waiting_for_company(
    store: FileLedgerStore,
) -> None:
    writer = await store.create_ledger()
    loop = asyncio.get_running_loop()
    started = loop.time()
    for i in range(20):
        await writer.append(payload(i))
    # 20 fsyncs take a few ms; any batching timer would show up here.
    assert loop.time() - started < 2.0


async def test_lone_append_is_written_on_the_loop_unless_the_lock_is_taken_or_sync_slow(
    store: FileLedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lone append skips the worker thread's two hand-offs (the latency of one submit);
    # it must never wait for the segment's lock on the loop (recovery may hold it for a
    # while) nor stall the loop behind a slow disk.
    threaded: list[str] = []
    real_in_thread = log_file._in_thread

    async def counting_in_thread(func: Any, *args: Any) -> Any:
        threaded.append(func.__name__)
        return await real_in_thread(func, *args)

    writer = await store.create_ledger()
    monkeypatch.setattr(log_file, "_in_thread", counting_in_thread)
    assert [await writer.append(payload(i)) for i in range(5)] == list(range(5))
    assert threaded == []

    lock_fd = os.open(store.log_path(writer.ledger_id), os.O_RDONLY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    appended = asyncio.ensure_future(writer.append(payload(5)))
    await asyncio.sleep(0.05)  # the loop runs: the append waits in the worker thread
    assert threaded == ["_write_batch_sync"] and not appended.done()
    fcntl.flock(lock_fd, fcntl.LOCK_UN)
    os.close(lock_fd)
    assert await appended == 5

    monkeypatch.setattr(log_file, "INLINE_SYNC_MAX_S", -1.0)  # "the disk is slow"
    assert await writer.append(payload(6)) == 6
    assert threaded == ["_write_batch_sync"] * 2
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    assert [e.data for e in await reader.read(0, 10)] == [payload(i) for i in range(7)]
    await reader.close()
    await writer.close()


async def test_fsync_failure_fails_appends_and_is_never_retried(
    store: FileLedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = await store.create_ledger()
    assert await writer.append(b"before") == 0
    fsync_attempts = 0

    def failing_fdatasync(fd: int) -> None:
        nonlocal fsync_attempts
        fsync_attempts += 1
        raise OSError(errno.EIO, "simulated disk failure")

    monkeypatch.setattr(os, "fdatasync", failing_fdatasync)
    results = await asyncio.gather(
        *(writer.append(payload(i)) for i in range(10)), return_exceptions=True
    )
    assert all(isinstance(r, LedgerError) for r in results)
    assert not any(isinstance(r, LedgerFencedError) for r in results)
    monkeypatch.undo()
    with pytest.raises(LedgerError):
        await writer.append(b"after the failure")
    assert fsync_attempts == 1
    assert writer.last_add_confirmed == 0
    assert await writer.close() == 0


async def test_write_failure_fails_appends(
    store: FileLedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = await store.create_ledger()

    def failing_write(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "simulated full disk")

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(LedgerError):
        await writer.append(b"x")
    monkeypatch.undo()
    with pytest.raises(LedgerError):
        await writer.append(b"y")


# -- ids, deletion, ledger list ----------------------------------------------------------------


async def test_ids_stay_unique_across_concurrent_stores(tmp_path: Path) -> None:
    stores = [FileLedgerStore(tmp_path) for _ in range(3)]
    try:
        writers = await asyncio.gather(*(s.create_ledger() for s in stores for _ in range(10)))
        ids = [w.ledger_id for w in writers]
        assert len(set(ids)) == 30
        assert sorted(ids) == list(range(1, 31))
    finally:
        for s in stores:
            await s.close()


async def test_ids_survive_deleting_every_ledger(tmp_path: Path) -> None:
    store = FileLedgerStore(tmp_path)
    writer = await store.create_ledger()
    await store.delete_ledger(writer.ledger_id)
    await store.close()
    store = FileLedgerStore(tmp_path)
    try:
        assert (await store.create_ledger()).ledger_id > writer.ledger_id
    finally:
        await store.close()


async def test_delete_removes_every_file_of_the_ledger(store: FileLedgerStore) -> None:
    writer = await store.create_ledger()
    await writer.append(b"x")
    await store.open_ledger(writer.ledger_id, recovery=True)
    prefix = f"ledger-{writer.ledger_id:012d}"
    assert any(name.startswith(prefix) for name in os.listdir(store.directory))
    await store.delete_ledger(writer.ledger_id)
    assert not any(name.startswith(prefix) for name in os.listdir(store.directory))
    with pytest.raises(NoSuchLedgerError):
        await store.open_ledger(writer.ledger_id, recovery=True)


async def test_tailing_reads_are_incremental(
    store: FileLedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = await store.create_ledger()
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    bytes_read = 0
    real_pread = os.pread

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        nonlocal bytes_read
        data = real_pread(fd, length, offset)
        bytes_read += len(data)
        return data

    monkeypatch.setattr(os, "pread", counting_pread)
    for i in range(200):
        await writer.append(payload(i))
        assert await reader.wait_for_entries(i - 1, WAIT_S)
        assert [e.data for e in await reader.read(i, 10)] == [payload(i)]
    # Re-reading the file from the start each time would read ~100x its size.
    assert bytes_read <= 3 * writer.size_bytes


async def test_ledger_list_file_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "state" / "ledgers.json"
    list_store = FileLedgerListStore(path)
    assert await list_store.get() == (LedgerList(), -1)
    assert await list_store.compare_and_set(LedgerList(writer="a", first_ledger_id=1), -1) == 0
    assert await list_store.compare_and_set(LedgerList(writer="b", first_ledger_id=1), 0) == 1
    assert sorted(os.listdir(path.parent)) == ["ledgers.json", "ledgers.json.lock"]
    assert await FileLedgerListStore(path).get() == (LedgerList(writer="b", first_ledger_id=1), 1)


async def test_corrupt_ledger_list_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "ledgers.json"
    path.write_bytes(b"{not json")
    with pytest.raises(LedgerError):
        await FileLedgerListStore(path).get()


# -- other processes ---------------------------------------------------------------------------

# The start of every child-process script: argv[1] is the repo root, argv[2] the ledger
# directory; new_writer() creates a ledger there and prints "LEDGER <id>".
CHILD_PROLOGUE = r"""
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from log.api import LedgerFencedError
from log.file import FileLedgerStore

async def new_writer():
    store = FileLedgerStore(sys.argv[2])
    writer = await store.create_ledger()
    print("LEDGER", writer.ledger_id, flush=True)
    return store, writer
"""

# Runs in a child process: appends from several tasks until fenced, printing each
# acknowledged entry id. argv[3]: time limit in seconds.
FENCED_WRITER_SCRIPT = (
    CHILD_PROLOGUE
    + r"""
async def main():
    store, writer = await new_writer()
    fenced = asyncio.Event()

    async def appender(task_number):
        sequence = 0
        while not fenced.is_set():
            try:
                entry_id = await writer.append(b"child-%d-%d" % (task_number, sequence))
            except LedgerFencedError:
                fenced.set()
                return
            print("ACK", entry_id, flush=True)
            sequence += 1
            await asyncio.sleep(0.001)

    await asyncio.wait_for(
        asyncio.gather(*(appender(n) for n in range(8))), timeout=float(sys.argv[3])
    )
    print("FENCED", flush=True)
    await store.close()

asyncio.run(main())
"""
)

# Runs in a child process: appends 300 entries in small bursts, then prints DONE.
TAILED_WRITER_SCRIPT = (
    CHILD_PROLOGUE
    + r"""
async def main():
    store, writer = await new_writer()
    await asyncio.sleep(0.05)  # let the parent start tailing an empty ledger
    for burst in range(30):
        await asyncio.gather(*(writer.append(b"burst-%d-%d" % (burst, i)) for i in range(10)))
        await asyncio.sleep(0.003)
    print("DONE", await writer.close(), flush=True)
    await store.close()

asyncio.run(main())
"""
)


async def start_child(script: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        REPO_ROOT,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def read_line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), WAIT_S)
    assert line, "child exited early"
    return line.decode().strip()


async def finish(process: asyncio.subprocess.Process) -> tuple[list[str], str, int]:
    """The child's remaining stdout lines, its stderr and exit code."""
    stdout, stderr = await asyncio.wait_for(process.communicate(), WAIT_S)
    assert process.returncode is not None
    return stdout.decode().split("\n"), stderr.decode(), process.returncode


async def kill_if_running(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
        await process.wait()


async def test_recovery_fences_writer_in_another_process(store: FileLedgerStore) -> None:
    child = await start_child(FENCED_WRITER_SCRIPT, store.directory, str(WAIT_S))
    try:
        first = await read_line(child)
        assert first.startswith("LEDGER ")
        ledger_id = int(first.split()[1])
        acked: list[int] = []
        while len(acked) < 30:
            line = await read_line(child)
            assert line.startswith("ACK "), line
            acked.append(int(line.split()[1]))

        reader = await store.open_ledger(ledger_id, recovery=True)
        last = reader.last_entry_id
        assert last is not None and last >= max(acked)

        rest, stderr, returncode = await finish(child)
        assert returncode == 0, stderr
        assert "FENCED" in rest
        acked += [int(line.split()[1]) for line in rest if line.startswith("ACK ")]
        # Every acknowledged append is part of the recovered ledger, and only those can be.
        assert max(acked) <= last
        assert sorted(acked) == list(range(len(acked)))
    finally:
        await kill_if_running(child)

    entries = await reader.read(0, last + 100)
    assert [e.entry_id for e in entries] == list(range(last + 1))
    assert all(e.data.startswith(b"child-") for e in entries)
    assert not await reader.wait_for_entries(last, 0.2)
    assert await reader.read(last + 1, 10) == []
    tailing = await FileLedgerStore(store.directory).open_ledger(ledger_id, recovery=False)
    try:
        assert len(await tailing.read(0, last + 100)) == last + 1
    finally:
        await tailing.close()


async def test_reader_tails_writer_in_another_process(store: FileLedgerStore) -> None:
    child = await start_child(TAILED_WRITER_SCRIPT, store.directory)
    try:
        first = await read_line(child)
        ledger_id = int(first.split()[1])
        reader = await store.open_ledger(ledger_id, recovery=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        entries: list[LedgerEntry] = []
        while len(entries) < 300:
            assert loop.time() < deadline, f"only {len(entries)} entries arrived"
            if await reader.wait_for_entries(len(entries) - 1, 0.5):
                entries.extend(await reader.read(len(entries), 1000))
        rest, stderr, returncode = await finish(child)
        assert returncode == 0, stderr
        assert "DONE 299" in rest
    finally:
        await kill_if_running(child)
    assert [e.entry_id for e in entries] == list(range(300))
    expected = [b"burst-%d-%d" % (burst, i) for burst in range(30) for i in range(10)]
    assert [e.data for e in entries] == expected
    assert all(e.last_add_confirmed < e.entry_id for e in entries)


async def test_recovery_does_not_wait_for_a_frozen_writer(store: FileLedgerStore) -> None:
    # A writer stopped (SIGSTOP) in the middle of a batch holds the segment's flock; a
    # second open file description holding it here plays that writer.
    writer = await store.create_ledger()
    acked = [await writer.append(payload(i)) for i in range(3)]
    frozen_fd = os.open(store.log_path(writer.ledger_id), os.O_RDWR)
    try:
        fcntl.flock(frozen_fd, fcntl.LOCK_EX)
        started = asyncio.get_running_loop().time()
        reader = await asyncio.wait_for(store.open_ledger(writer.ledger_id, recovery=True), 5)
        took_s = asyncio.get_running_loop().time() - started
    finally:
        os.close(frozen_fd)
    assert took_s < 2.0, f"recovery waited {took_s:.2f} s for the frozen writer"
    assert reader.last_entry_id == max(acked)
    # The writer resumes: nothing more of it is ever acknowledged.
    with pytest.raises(LedgerFencedError):
        await writer.append(payload(3))
    assert [e.entry_id for e in await reader.read(0, 10)] == acked
    await reader.close()


async def test_batch_written_after_recovery_started_is_not_acknowledged(
    store: FileLedgerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer passed its fence check, then recovery created its marker and measured the
    # ledger before the batch's bytes landed (the writer was frozen in between): the batch
    # must fail even though its bytes are in the file.
    writer = await store.create_ledger()
    assert await writer.append(payload(0)) == 0
    real_write_all = log_file._write_all

    def write_after_fencing(fd: int, data: bytes) -> None:
        open(store.fencing_path(writer.ledger_id), "wb").close()
        real_write_all(fd, data)

    monkeypatch.setattr(log_file, "_write_all", write_after_fencing)
    with pytest.raises(LedgerFencedError):
        await writer.append(payload(1))
    monkeypatch.setattr(log_file, "_write_all", real_write_all)
    reader = await store.open_ledger(writer.ledger_id, recovery=True)
    # Recovery counts what is in the file; the client was never told entry 1 succeeded.
    assert reader.last_entry_id is not None and reader.last_entry_id >= 0
    await reader.close()
    await store.delete_ledger(writer.ledger_id)
    assert not await asyncio.to_thread(os.path.exists, store.fencing_path(writer.ledger_id))
