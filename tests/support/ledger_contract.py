"""The ledger contract's tests (log/api.py, docs/DESIGN.md §3), written once for every backend.

A test module takes them with ``globals().update(contract_tests())`` beside a ``backend``
fixture of its own (a :class:`~tests.support.ledger_backends.LedgerBackend`):
tests/unit/test_ledger_contract.py over the in-process backends and pulsar-lite,
tests/integration/test_ledger_real_pulsar.py over real Apache Pulsar (a JVM).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from log.api import (
    LedgerClosedError,
    LedgerEntry,
    LedgerError,
    LedgerFencedError,
    LedgerInfo,
    LedgerList,
    LedgerReader,
    LedgerState,
    LedgerStore,
    LedgerWriter,
    NoSuchLedgerError,
)
from tests.support.ledger_backends import LedgerBackend
from tests.support.ledger_lists import check_compare_and_set, one_winner

# Every wait in these tests is bounded by this.
WAIT_S = 5.0


@pytest.fixture
def store(backend: LedgerBackend) -> LedgerStore:
    return backend.new_store()


def payload(entry_id: int) -> bytes:
    return f"entry-{entry_id:05d}".encode() * 3


async def append_sequentially(writer: LedgerWriter, count: int) -> list[int]:
    return [await writer.append(payload(i)) for i in range(count)]


async def writing(backend: LedgerBackend, count: int) -> tuple[LedgerStore, LedgerWriter]:
    """A new store and a ledger written through it with ``count`` entries, in order."""
    store = backend.new_store()
    writer = await store.create_ledger()
    await append_sequentially(writer, count)
    return store, writer


async def recover(backend: LedgerBackend, writer: LedgerWriter) -> LedgerReader:
    """``writer``'s ledger opened for recovery through another store (a new leader)."""
    return await backend.new_store().open_ledger(writer.ledger_id, recovery=True)


async def read_all(reader: LedgerReader, count: int) -> list[bytes]:
    entries = await reader.read(0, count + 10)
    assert [e.entry_id for e in entries] == list(range(len(entries)))
    assert all(e.ledger_id == reader.ledger_id for e in entries)
    return [e.data for e in entries]


async def tail(reader: LedgerReader, count: int) -> list[bytes]:
    """Read ``count`` entries as they arrive, the way a follower does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    entries: list[LedgerEntry] = []
    while len(entries) < count:
        assert loop.time() < deadline, f"only {len(entries)} of {count} entries arrived"
        if await reader.wait_for_entries(len(entries) - 1, 0.5):
            entries.extend(await reader.read(len(entries), 1000))
    assert [e.entry_id for e in entries] == list(range(count))
    return [e.data for e in entries]


# -- appending and reading --------------------------------------------------------------------


async def test_appends_get_ids_from_zero_and_read_back_in_order(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    assert writer.last_add_confirmed == -1
    assert await append_sequentially(writer, 10) == list(range(10))
    assert writer.last_add_confirmed == 9
    assert writer.size_bytes >= sum(len(payload(i)) for i in range(10))
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    assert reader.last_entry_id is None
    assert await read_all(reader, 10) == [payload(i) for i in range(10)]


async def test_read_returns_requested_range_only(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    await append_sequentially(writer, 10)
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    assert [e.entry_id for e in await reader.read(3, 4)] == [3, 4, 5, 6]
    assert [e.entry_id for e in await reader.read(8, 100)] == [8, 9]
    assert [e.data for e in await reader.read(5, 1)] == [payload(5)]
    assert await reader.read(10, 5) == []
    assert await reader.read(50, 5) == []
    assert await reader.read(0, 0) == []
    with pytest.raises(ValueError):
        await reader.read(-1, 5)


async def test_sequential_appends_carry_previous_entry_as_lac(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    await append_sequentially(writer, 5)
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    # Each append was issued after the previous one was durable.
    assert [e.last_add_confirmed for e in await reader.read(0, 5)] == [-1, 0, 1, 2, 3]


async def test_many_concurrent_appends_get_consecutive_ids_in_order(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    count = 5000
    completed: list[int] = []
    futures = [writer.append(payload(i)) for i in range(count)]
    for future in futures:
        future.add_done_callback(lambda f: completed.append(f.result()))
    assert await asyncio.wait_for(asyncio.gather(*futures), WAIT_S) == list(range(count))
    assert completed == list(range(count))
    assert writer.last_add_confirmed == count - 1
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    entries = await reader.read(0, count)
    assert [e.data for e in entries] == [payload(i) for i in range(count)]
    lacs = [e.last_add_confirmed for e in entries]
    assert all(lac < e.entry_id for lac, e in zip(lacs, entries, strict=True))
    assert lacs == sorted(lacs)


async def test_tailing_reader_sees_entries_as_they_are_appended(backend: LedgerBackend) -> None:
    writer_store, reader_store = backend.new_store(), backend.new_store()
    writer = await writer_store.create_ledger()
    same_store_reader = await writer_store.open_ledger(writer.ledger_id, recovery=False)
    other_store_reader = await reader_store.open_ledger(writer.ledger_id, recovery=False)
    assert await other_store_reader.read(0, 10) == []
    assert not await other_store_reader.wait_for_entries(-1, 0.02)

    async def produce() -> None:
        for i in range(60):
            await writer.append(payload(i))
            if i % 7 == 0:
                await asyncio.sleep(0.003)  # let readers catch up and go back to waiting

    producer = asyncio.create_task(produce())
    expected = [payload(i) for i in range(60)]
    assert await tail(same_store_reader, 60) == expected
    assert await tail(other_store_reader, 60) == expected
    await asyncio.wait_for(producer, WAIT_S)
    entries = await other_store_reader.read(0, 60)
    assert all(e.last_add_confirmed < e.entry_id for e in entries)


async def test_wait_for_entries_returns_at_once_when_entries_are_there(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    await append_sequentially(writer, 3)
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    assert await reader.wait_for_entries(1, 0)
    assert not await reader.wait_for_entries(2, 0.02)


# -- closing -----------------------------------------------------------------------------------


async def test_closed_writer_refuses_appends(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    futures = [writer.append(payload(i)) for i in range(20)]
    assert await writer.close() == 19  # drained the pending appends first
    assert [f.result() for f in futures] == list(range(20))
    with pytest.raises(LedgerClosedError):
        await writer.append(b"late")
    empty = await store.create_ledger()
    assert await empty.close() == -1


async def test_store_close_drains_pending_appends(backend: LedgerBackend) -> None:
    store = backend.new_store()
    writer = await store.create_ledger()
    futures = [writer.append(payload(i)) for i in range(50)]
    await store.close()
    assert [f.result() for f in futures] == list(range(50))
    reader = await recover(backend, writer)
    assert reader.last_entry_id == 49


# -- recovery and fencing ----------------------------------------------------------------------


async def test_recovery_reports_length_and_is_repeatable(backend: LedgerBackend) -> None:
    _store, writer = await writing(backend, 7)  # the store stays open
    reader = await recover(backend, writer)
    assert reader.last_entry_id == 6
    assert await read_all(reader, 7) == [payload(i) for i in range(7)]
    again = await recover(backend, writer)
    assert again.last_entry_id == 6


async def test_recovery_of_empty_ledger(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    reader = await store.open_ledger(writer.ledger_id, recovery=True)
    assert reader.last_entry_id == -1
    assert await reader.read(0, 10) == []
    with pytest.raises(LedgerFencedError):
        await writer.append(b"x")


async def test_recovery_of_closed_ledger_keeps_everything(store: LedgerStore) -> None:
    writer = await store.create_ledger()
    await append_sequentially(writer, 4)
    await writer.close()
    reader = await store.open_ledger(writer.ledger_id, recovery=True)
    assert reader.last_entry_id == 3


async def test_recovery_fences_writer(backend: LedgerBackend) -> None:
    store, writer = await writing(backend, 3)
    reader = await recover(backend, writer)
    assert reader.last_entry_id == 2
    if not store.can_fence:
        # No fencing (pulsar-lite): the writer goes on, but the recovered end is final.
        await assert_recovered_end_is_final(backend, writer, 2)
        return
    with pytest.raises(LedgerFencedError):
        await asyncio.wait_for(writer.append(b"after fence"), WAIT_S)
    with pytest.raises(LedgerFencedError):
        await asyncio.wait_for(writer.append(b"and again"), WAIT_S)
    assert await read_all(reader, 3) == [payload(i) for i in range(3)]
    assert writer.last_add_confirmed == 2


async def test_pending_appends_never_succeed_past_recovered_length(backend: LedgerBackend) -> None:
    store, writer = await writing(backend, 5)
    futures = [writer.append(payload(5 + i)) for i in range(300)]
    reader = await recover(backend, writer)
    last = reader.last_entry_id
    assert last is not None and last >= 4
    if not store.can_fence:
        # No fencing (pulsar-lite): appends in flight may even be acknowledged by the
        # ledger (the node's ZooKeeper check keeps them from clients), never read back.
        await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), WAIT_S)
        await assert_recovered_end_is_final(backend, writer, last)
        return
    results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), WAIT_S)
    succeeded = [r for r in results if isinstance(r, int)]
    failed = [r for r in results if not isinstance(r, int)]
    assert all(isinstance(r, LedgerFencedError) for r in failed)
    assert succeeded == list(range(5, 5 + len(succeeded)))  # a prefix: ids complete in order
    assert all(entry_id <= last for entry_id in succeeded)
    assert await read_all(reader, last + 1) == [payload(i) for i in range(last + 1)]


async def assert_recovered_end_is_final(
    backend: LedgerBackend, writer: LedgerWriter, last: int
) -> None:
    """What a backend that cannot fence guarantees instead: after recovery the writer's
    appends (acknowledged or not) are never read, and recovering again finds the same end."""
    with contextlib.suppress(LedgerError):
        await asyncio.wait_for(writer.append(b"after recovery"), WAIT_S)
    late = await backend.new_store().open_ledger(writer.ledger_id, recovery=False)
    assert await read_all(late, last + 1) == [payload(i) for i in range(last + 1)]
    assert await late.read(last + 1, 1000) == []
    again = await recover(backend, writer)
    assert again.last_entry_id == last


async def test_readers_never_see_past_recovered_length(backend: LedgerBackend) -> None:
    store, writer = await writing(backend, 4)
    tailing = await backend.new_store().open_ledger(writer.ledger_id, recovery=False)
    recovered = await recover(backend, writer)
    assert recovered.last_entry_id == 3
    if store.can_fence:
        with pytest.raises(LedgerError):
            await writer.append(b"fenced")
    else:
        # A writer in another process is not fenced: its late appends may even be
        # acknowledged, but no reader may ever return them.
        await asyncio.wait_for(writer.append(b"deposed"), WAIT_S)
        assert not await tailing.wait_for_entries(3, 0.05)
        late_reader = await backend.new_store().open_ledger(writer.ledger_id, recovery=False)
        assert [e.entry_id for e in await late_reader.read(0, 100)] == [0, 1, 2, 3]
        again = await recover(backend, writer)
        assert again.last_entry_id == 3
    for reader in (tailing, recovered):
        assert not await reader.wait_for_entries(3, 0.05)
        assert await reader.read(4, 10) == []
        assert len(await reader.read(0, 100)) == 4


# -- ids, deletion, restart --------------------------------------------------------------------


async def test_ledger_ids_increase_and_are_listed(store: LedgerStore) -> None:
    writers = [await store.create_ledger() for _ in range(3)]
    ids = [w.ledger_id for w in writers]
    assert ids == sorted(set(ids))
    assert await store.list_ledgers() == ids
    await store.delete_ledger(ids[-1])
    newer = await store.create_ledger()
    assert newer.ledger_id > ids[-1]  # never reuses a deleted id
    assert await store.list_ledgers() == [*ids[:-1], newer.ledger_id]


async def test_delete_ledger(backend: LedgerBackend) -> None:
    store, writer = await writing(backend, 3)
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    other_reader = await backend.new_store().open_ledger(writer.ledger_id, recovery=False)
    await store.delete_ledger(writer.ledger_id)
    assert writer.ledger_id not in await store.list_ledgers()
    for open_reader in (reader, other_reader):
        with pytest.raises(NoSuchLedgerError):
            await open_reader.read(0, 10)
        with pytest.raises(NoSuchLedgerError):
            await open_reader.wait_for_entries(10, 0.05)
    for recovery in (False, True):
        with pytest.raises(NoSuchLedgerError):
            await store.open_ledger(writer.ledger_id, recovery=recovery)
    with pytest.raises(LedgerError):
        await asyncio.wait_for(writer.append(b"into a deleted ledger"), WAIT_S)
    await store.delete_ledger(writer.ledger_id)  # idempotent
    await store.delete_ledger(10**9)  # unknown id: not an error


async def test_unknown_ledger_cannot_be_opened(store: LedgerStore) -> None:
    for recovery in (False, True):
        with pytest.raises(NoSuchLedgerError):
            await store.open_ledger(424242, recovery=recovery)


async def test_reopen_after_store_restart(backend: LedgerBackend) -> None:
    store = backend.new_store()
    first = await store.create_ledger()
    await append_sequentially(first, 10)
    await first.close()
    second = await store.create_ledger()
    await append_sequentially(second, 3)
    await store.close()  # second's writer is still open: closing the store closes it

    restarted = backend.new_store()
    assert await restarted.list_ledgers() == [first.ledger_id, second.ledger_id]
    for writer, count in ((first, 10), (second, 3)):
        reader = await restarted.open_ledger(writer.ledger_id, recovery=True)
        assert reader.last_entry_id == count - 1
        assert await read_all(reader, count) == [payload(i) for i in range(count)]
    third = await restarted.create_ledger()
    assert third.ledger_id > second.ledger_id
    assert await third.append(b"x") == 0


# -- ledger list -------------------------------------------------------------------------------


SAMPLE_LIST = LedgerList(
    ledgers=(
        LedgerInfo(
            ledger_id=3, created_ms=1_700_000_000_000, state=LedgerState.CLOSED, last_entry_id=41
        ),
        LedgerInfo(ledger_id=4, created_ms=1_700_000_100_000, state=LedgerState.CLOSING),
        LedgerInfo(ledger_id=7, created_ms=1_700_000_200_000, state=LedgerState.OPEN),
    ),
    first_ledger_id=1,
    writer="broker-2",
    extra={"cluster": "test"},
)


async def test_ledger_list_starts_empty(backend: LedgerBackend) -> None:
    assert await backend.new_list_store().get() == (LedgerList(), -1)


async def test_ledger_list_compare_and_set(backend: LedgerBackend) -> None:
    list_store = backend.new_list_store()
    _, updated, new_version = await check_compare_and_set(list_store, SAMPLE_LIST, "broker-3")
    assert await list_store.get() == (updated, new_version)
    # Another handle on the same storage (a restarted process) sees the same.
    assert await backend.new_list_store().get() == (updated, new_version)


async def test_ledger_list_concurrent_compare_and_set_has_one_winner(
    backend: LedgerBackend,
) -> None:
    stores = [backend.new_list_store() for _ in range(4)]
    version = await stores[0].compare_and_set(SAMPLE_LIST, -1)
    for round_number in range(5):
        version = await one_winner(stores, round_number, version)
        current, current_version = await stores[0].get()
        assert current_version == version
        assert current.writer.startswith(f"{round_number}-")


async def test_owner_confirmed_lac_caps_what_entries_confirm(store: LedgerStore) -> None:
    # A replicated log confirms entries itself (after its leadership check): entries then
    # carry min(durable, confirmed), so unconfirmed durable entries confirm nothing.
    writer = await store.create_ledger()
    writer.confirm(-1)
    await append_sequentially(writer, 3)
    writer.confirm(1)
    await append_sequentially(writer, 2)
    writer.confirm(0)  # never goes back
    await append_sequentially(writer, 1)
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    assert [e.last_add_confirmed for e in await reader.read(0, 10)] == [-1, -1, -1, 1, 1, 1]
    assert writer.last_add_confirmed == 5  # the durable horizon itself is unchanged
    await reader.close()


def contract_tests() -> dict[str, object]:
    """The contract's tests and its ``store`` fixture, for a test module's namespace."""
    return {
        name: value
        for name, value in globals().items()
        if name.startswith("test_") or name == "store"
    }
