"""Steward's Pulsar ledgers under faults of a real Pulsar cluster (issue 31, item 5: a bookie
and a broker killed; docs/TESTING.md, "A real Pulsar cluster"; docs/DESIGN.md §3).

One cluster for the module (tests/support/pulsar_cluster.py: ZooKeeper, three bookies, two
brokers, ensemble 2 and write and ack quorums 2), started by the first test and killed when
the module ends, whatever happened. The load is Steward's own ledger writer
(:class:`~log.pulsar.PulsarLedgerStore` with ``PulsarConfig.for_apache_pulsar``:
ExclusiveWithFencing producer, one topic per ledger) appending without pause, several
appends in flight; an append counts as acknowledged when its future resolves. Each test
kills one JVM with SIGKILL mid-load, then checks that appends go on, that the ledger read back
from the start (by a new store, after the writer's clean close) holds every acknowledged
entry, in order, with no gap, and that the member restarted leaves the cluster healthy.

- A bookie of the ledger's current ensemble: the BookKeeper client replaces it by the spare
  bookie (an ensemble change). The appends that count are those after the dead bookie's
  ZooKeeper session expired: until then it is still listed as available, and a broker that
  cannot change an ensemble rolls over to new ledgers placed on it, each taking a write or
  two. With no spare bookie (ensemble 3 on three bookies) and an ack quorum of 2, the same
  test fails: appends stop once the bookie is gone from the list.
- The broker that owns the ledger's topic: its ownership (a ZooKeeper ephemeral node) goes
  with its session, the other broker takes the topic over, and the Pulsar client behind
  Steward's writer and a tailing reader reconnects there (the service URL names both
  brokers) and resends what was not acknowledged; the readers drop the duplicates by entry
  id. With one broker, the same test fails: nothing takes the topic over.

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from log.api import LedgerReader, LedgerWriter
from log.pulsar import PulsarConfig, PulsarLedgerReader, PulsarLedgerStore
from tests.support.ledger_backends import MemoryLedgerIds
from tests.support.pulsar_cluster import PulsarCluster, started_cluster

# The first test's set-up starts the cluster (about 45 s here; each member bounded).
pytestmark = pytest.mark.timeout(600)

#: Acknowledged appends before the fault, and after it.
BEFORE_FAULT = 200
AFTER_FAULT = 300
#: Appends in flight at once.
IN_FLIGHT = 10
#: Bound of the waits for appends to go on after a fault: a broker's ZooKeeper session
#: (6 s) must expire before another broker takes its topics.
PROGRESS_TIMEOUT_S = 120.0
OWNER_TIMEOUT_S = 90.0
READ_BATCH = 1000


def payload(entry_id: int) -> bytes:
    return f"entry-{entry_id:08d}".encode().ljust(100, b".")


@pytest.fixture(scope="module")
def pulsar_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarCluster]:
    yield from started_cluster(tmp_path_factory, brokers=2)


def cluster_config(cluster: PulsarCluster) -> PulsarConfig:
    return PulsarConfig.for_apache_pulsar(
        cluster.service_url,
        cluster.admin_url,
        cluster=f"t{uuid.uuid4().hex[:12]}",
        operation_timeout_s=30.0,
        send_timeout_ms=60_000,
    )


@pytest.fixture
async def stores(pulsar_cluster: PulsarCluster) -> AsyncIterator[list[PulsarLedgerStore]]:
    """Two stores on one config and ledger ids: the writer's and a reader's."""
    config = cluster_config(pulsar_cluster)
    ids = MemoryLedgerIds()
    opened = [PulsarLedgerStore(config, ids), PulsarLedgerStore(config, ids)]
    try:
        await opened[0].ensure_namespace_retention()
        yield opened
    finally:
        for store in opened:
            await store.close()


class AppendLoad:
    """Appends to ``writer`` without pause, :data:`IN_FLIGHT` at a time, until stopped or
    an append fails; records the acknowledged entry ids in order."""

    def __init__(self, writer: LedgerWriter) -> None:
        self._writer = writer
        self.acked: list[int] = []
        self.failure: BaseException | None = None
        #: Appends were still in flight when :meth:`stop` gave up waiting for them.
        self.unanswered = False
        self._stopping = False
        self._progress = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        next_id = 0
        while not self._stopping:
            futures = [self._writer.append(payload(next_id + k)) for k in range(IN_FLIGHT)]
            next_id += IN_FLIGHT
            results = await asyncio.gather(*futures, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    self.failure = result
                    self._progress.set()
                    return
                self.acked.append(result)
            self._progress.set()

    async def wait_acked(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < count:
            if self.failure is not None:
                raise AssertionError(
                    f"an append failed after {len(self.acked)} acknowledged: {self.failure!r}"
                )
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise AssertionError(
                    f"{len(self.acked)} appends acknowledged, not {count}, in {timeout_s:.0f} s"
                )
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), remaining_s)

    async def stop(self) -> None:
        """Lets the appends in flight end (bounded); cancels the load if they do not."""
        self._stopping = True
        done, _ = await asyncio.wait({self._task}, timeout=PROGRESS_TIMEOUT_S)
        if not done:
            self.unanswered = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class TailingReader:
    """Reads a ledger as it grows (a follower's way), recording the entries in order."""

    def __init__(self, reader: LedgerReader) -> None:
        self._reader = reader
        self.entries: list[tuple[int, bytes]] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            after = self.entries[-1][0] if self.entries else -1
            if await self._reader.wait_for_entries(after, timeout_s=5.0):
                for entry in await self._reader.read(after + 1, READ_BATCH):
                    self.entries.append((entry.entry_id, entry.data))

    async def wait_read(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.entries) < count:
            if self._task.done():
                raise AssertionError(f"the tailing reader failed: {self._task.exception()!r}")
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"the tailing reader has {len(self.entries)} entries, not {count}, "
                    f"after {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


async def wait_until_gone(cluster: PulsarCluster, bookie_id: str) -> None:
    deadline = time.monotonic() + PROGRESS_TIMEOUT_S
    while bookie_id in await asyncio.to_thread(cluster.available_bookies):
        if time.monotonic() >= deadline:
            raise AssertionError(f"bookie {bookie_id} still available {PROGRESS_TIMEOUT_S} s on")
        await asyncio.sleep(0.5)


def assert_complete(entries: list[tuple[int, bytes]], acked: list[int]) -> None:
    """Every acknowledged entry is there, in order, no gap, each with its payload."""
    ids = [entry_id for entry_id, _ in entries]
    assert ids == list(range(len(ids))), "entries out of order or with a gap"
    assert acked == list(range(len(acked))), "acknowledgements out of order"
    assert len(ids) >= len(acked), f"{len(acked)} acknowledged, {len(ids)} stored"
    for entry_id, data in entries:
        assert data == payload(entry_id), f"entry {entry_id} holds {data[:20]!r}"


async def read_back(store: PulsarLedgerStore, ledger_id: int) -> list[tuple[int, bytes]]:
    """The whole closed ledger, up to its SEAL, from a store that did not write it."""
    reader = await store.open_ledger(ledger_id, recovery=False)
    assert isinstance(reader, PulsarLedgerReader)
    try:
        entries: list[tuple[int, bytes]] = []
        while batch := await reader.read(len(entries), READ_BATCH):
            entries.extend((entry.entry_id, entry.data) for entry in batch)
        # read() returns nothing only at the SEAL (or after its bounded wait).
        assert reader.sealed_last_entry_id == len(entries) - 1, (
            f"read {len(entries)} entries, the SEAL says {reader.sealed_last_entry_id}"
        )
        return entries
    finally:
        await reader.close()


async def test_a_killed_bookie_is_replaced_and_nothing_acknowledged_is_lost(
    pulsar_cluster: PulsarCluster, stores: list[PulsarLedgerStore]
) -> None:
    writer_store, reader_store = stores
    writer = await writer_store.create_ledger()
    topic = writer_store.config.topic(writer.ledger_id)
    load = AppendLoad(writer)
    try:
        await load.wait_acked(BEFORE_FAULT, PROGRESS_TIMEOUT_S)
        ensembles = await asyncio.to_thread(pulsar_cluster.ledger_ensembles, topic)
        assert ensembles, f"no ensemble for {topic}"
        victim = next(b for b in pulsar_cluster.bookies if b.bookie_id in ensembles[-1])
        pulsar_cluster.kill9(victim)
        # Until its ZooKeeper session expires, the dead bookie is still listed as available
        # and the broker may roll over to new ledgers placed on it, each taking a write or
        # two: the appends that count are those after it is gone from the list.
        await wait_until_gone(pulsar_cluster, victim.bookie_id)
        gone_at = len(load.acked)
        await load.wait_acked(gone_at + AFTER_FAULT, PROGRESS_TIMEOUT_S)
        # They went to an ensemble without it.
        now = await asyncio.to_thread(pulsar_cluster.ledger_ensembles, topic)
        assert victim.bookie_id not in now[-1], now
    finally:
        await load.stop()
    assert load.failure is None and not load.unanswered, repr(load.failure)
    await writer.close()
    # Read with the bookie still down: every entry has a copy on a live bookie.
    assert_complete(await read_back(reader_store, writer.ledger_id), load.acked)
    pulsar_cluster.restart(victim)
    await asyncio.to_thread(pulsar_cluster.wait_healthy)


async def test_the_topic_owner_killed_the_other_broker_takes_over_and_nothing_is_lost(
    pulsar_cluster: PulsarCluster, stores: list[PulsarLedgerStore]
) -> None:
    assert len(pulsar_cluster.brokers) == 2
    writer_store, reader_store = stores
    writer = await writer_store.create_ledger()
    topic = writer_store.config.topic(writer.ledger_id)
    tailing = TailingReader(await reader_store.open_ledger(writer.ledger_id, recovery=False))
    load = AppendLoad(writer)
    try:
        await load.wait_acked(BEFORE_FAULT, PROGRESS_TIMEOUT_S)
        owner = await asyncio.to_thread(pulsar_cluster.owner_of, topic)
        assert owner is not None, f"no broker owns {topic}"
        pulsar_cluster.kill9(owner)
        at_kill = len(load.acked)
        await load.wait_acked(at_kill + AFTER_FAULT, PROGRESS_TIMEOUT_S)
        new_owner = await asyncio.to_thread(pulsar_cluster.owner_of, topic)
        assert new_owner is not None and new_owner is not owner
        # The reader followed too (the last entry is visible once a later one carries its LAC).
        await tailing.wait_read(at_kill + AFTER_FAULT - IN_FLIGHT, PROGRESS_TIMEOUT_S)
    finally:
        await load.stop()
        await tailing.close()
    assert load.failure is None and not load.unanswered, repr(load.failure)
    await writer.close()
    assert_complete(tailing.entries, load.acked[: len(tailing.entries)])
    assert_complete(await read_back(reader_store, writer.ledger_id), load.acked)
    pulsar_cluster.restart(owner)
    await asyncio.to_thread(pulsar_cluster.wait_healthy)
