"""Against a real ZooKeeper server: the server helper, the ledger list, the leader elector.

Sessions are short (2-3 s; the server's tickTime=500 allows 1-10 s) so failures are seen
quickly; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from broker.ha.election import ElectionError, LeaderElector, LeadershipStatus
from clients.dev.local_server import free_port
from clients.dev.zk import ZooKeeperServer, four_letter_word
from log.api import BadVersionError, LedgerError, LedgerInfo, LedgerList, LedgerState
from log.zk_list import ZooKeeperLedgerListStore, ledger_list_path
from tests.support.ledger_lists import check_compare_and_set, one_winner
from tests.support.zk_clients import SESSION_TIMEOUT_S, close_client, start_client

if TYPE_CHECKING:
    # Only for annotations: importing the plugin module here would keep pytest from
    # rewriting its asserts.
    from tests.support.zk_fixture import ElectorProcessFactory


# kazoo declares the connection dropped after 2/3 of the session timeout without an answer.
SUSPEND_DETECTION_S = SESSION_TIMEOUT_S * 2 / 3

SAMPLE_LIST = LedgerList(
    ledgers=(
        LedgerInfo(
            ledger_id=3, created_ms=1_700_000_000_000, state=LedgerState.CLOSED, last_entry_id=41
        ),
        LedgerInfo(ledger_id=7, created_ms=1_700_000_200_000, state=LedgerState.OPEN),
    ),
    first_ledger_id=1,
    writer="broker-2",
    extra={"cluster": "test"},
)


# -- helpers -------------------------------------------------------------------------------------


def new_cluster() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


async def wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02
) -> float:
    """Poll ``condition`` until true; returns the seconds it took, fails after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        elapsed_s = time.monotonic() - started
        if elapsed_s > timeout_s:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


def leaders(electors: list[LeaderElector]) -> list[LeaderElector]:
    return [e for e in electors if e.is_leader()]


def one_leader_agreed(electors: list[LeaderElector]) -> bool:
    """Exactly one leader, and every elector names it."""
    found = leaders(electors)
    if len(found) != 1:
        return False
    return all(
        (info := e.leader_info()) is not None and info["broker_id"] == found[0].broker_id
        for e in electors
    )


@contextlib.asynccontextmanager
async def started_electors(
    connect_string: str,
    cluster: str,
    count: int,
    *,
    session_timeout_s: float = SESSION_TIMEOUT_S,
    join: bool = True,
    on_change: Callable[[str, LeadershipStatus], None] | None = None,
) -> AsyncIterator[list[LeaderElector]]:
    electors: list[LeaderElector] = []
    try:
        for index in range(count):
            broker_id = f"b{index}"
            callback = None
            if on_change is not None:
                callback = _bind(on_change, broker_id)
            elector = LeaderElector(
                connect_string,
                cluster,
                broker_id,
                {"http": f"http://127.0.0.1:{8000 + index}", "worker": f"127.0.0.1:{9000 + index}"},
                session_timeout_s=session_timeout_s,
                on_change=callback,
            )
            electors.append(elector)
            await elector.start()
            if join:
                await elector.join()
        yield electors
    finally:
        for elector in electors:
            await elector.stop()


def _bind(
    on_change: Callable[[str, LeadershipStatus], None], broker_id: str
) -> Callable[[LeadershipStatus], None]:
    return lambda status: on_change(broker_id, status)


async def queue_children(connect_string: str, cluster: str, kind: str = "election") -> list[str]:
    """The children of ``/steward/<cluster>/<kind>``, read by a session of its own."""
    client = await start_client(connect_string)
    try:
        children: list[str] = await asyncio.to_thread(
            client.get_children, f"/steward/{cluster}/{kind}"
        )
        return sorted(children)
    finally:
        await close_client(client)


# -- the server ----------------------------------------------------------------------------------


def test_server_is_ready_on_loopback(zookeeper: ZooKeeperServer) -> None:
    assert zookeeper.connect_string == f"127.0.0.1:{zookeeper.port}"
    answer = four_letter_word(zookeeper.host, zookeeper.port, "srvr")
    assert "Mode: standalone" in answer
    config = zookeeper.config_path.read_text()
    assert "clientPortAddress=127.0.0.1" in config
    assert "tickTime=500" in config


# -- the ledger list -----------------------------------------------------------------------------


async def test_ledger_list_compare_and_set(zookeeper: ZooKeeperServer) -> None:
    client = await start_client(zookeeper.connect_string)
    other = await start_client(zookeeper.connect_string)
    try:
        path = ledger_list_path(new_cluster())
        store = ZooKeeperLedgerListStore(client, path)
        assert await store.get() == (LedgerList(), -1)
        assert await store.confirmed_version() == -1
        version, updated, new_version = await check_compare_and_set(store, SAMPLE_LIST, "b3")
        assert new_version == version + 1
        # Another session (another broker) writes; sync then get sees it at once.
        other_store = ZooKeeperLedgerListStore(other, path)
        latest = LedgerList(ledgers=updated.ledgers, first_ledger_id=1, writer="b4")
        latest_version = await other_store.compare_and_set(latest, new_version)
        # The leader's check after a group commit sees the other writer's change too.
        assert await store.confirmed_version() == latest_version
        await store.sync()
        assert await store.get() == (latest, latest_version)
        with pytest.raises(BadVersionError):
            await store.compare_and_set(updated, new_version)  # deposed writer
    finally:
        await close_client(client)
        await close_client(other)


async def test_ledger_list_concurrent_compare_and_set_has_one_winner(
    zookeeper: ZooKeeperServer,
) -> None:
    clients = [await start_client(zookeeper.connect_string) for _ in range(3)]
    try:
        path = ledger_list_path(new_cluster())
        stores = [ZooKeeperLedgerListStore(c, path) for c in clients]
        version = -1
        for round_number in range(5):
            version = await one_winner(stores, round_number, version)
            await stores[1].sync()
            current, current_version = await stores[1].get()
            assert current_version == version
            assert current.writer.startswith(f"{round_number}-")
    finally:
        for client in clients:
            await close_client(client)


async def test_ledger_list_fails_fast_without_connection(zookeeper: ZooKeeperServer) -> None:
    client = await start_client(zookeeper.connect_string)
    store = ZooKeeperLedgerListStore(client, ledger_list_path(new_cluster()))
    await close_client(client)
    started = time.monotonic()
    with pytest.raises(LedgerError):
        await store.get()
    with pytest.raises(LedgerError):
        await store.compare_and_set(SAMPLE_LIST, -1)
    assert time.monotonic() - started < 1.0


# -- the elector ---------------------------------------------------------------------------------


async def test_three_electors_agree_on_one_leader(zookeeper: ZooKeeperServer) -> None:
    loop_thread = threading.get_ident()
    callback_threads: set[int] = set()
    changes: list[tuple[str, LeadershipStatus]] = []

    def on_change(broker_id: str, status: LeadershipStatus) -> None:
        callback_threads.add(threading.get_ident())
        changes.append((broker_id, status))

    cluster = new_cluster()
    async with started_electors(
        zookeeper.connect_string, cluster, 3, on_change=on_change
    ) as electors:
        await wait_for(lambda: one_leader_agreed(electors), 5, "one leader named by all")
        leader = leaders(electors)[0]
        assert leader.broker_id == "b0"  # the first to join
        info = electors[2].leader_info()
        assert info == {
            "broker_id": "b0",
            "http": "http://127.0.0.1:8000",
            "worker": "127.0.0.1:9000",
        }
        await wait_for(
            lambda: all(len(e.brokers()) == 3 for e in electors), 5, "all see three brokers"
        )
        for elector in electors:
            assert [b["broker_id"] for b in elector.brokers()] == ["b0", "b1", "b2"]
            assert elector.brokers()[1]["http"] == "http://127.0.0.1:8001"
        assert len(await queue_children(zookeeper.connect_string, cluster)) == 3
        assert ("b0", leader.status()) in changes
        assert callback_threads == {loop_thread}
    # stop() left the queue and removed the advertisements.
    assert await queue_children(zookeeper.connect_string, cluster) == []


async def test_start_fails_clearly_without_zookeeper() -> None:
    elector = LeaderElector(
        f"127.0.0.1:{free_port()}", new_cluster(), "b0", {}, connect_timeout_s=1.0
    )
    started = time.monotonic()
    with pytest.raises(ElectionError, match="cannot reach ZooKeeper"):
        await elector.start()
    assert time.monotonic() - started < 5.0
    with pytest.raises(ElectionError):
        await elector.join()
    await elector.stop()  # idempotent after a failed start


async def test_leave_hands_leadership_over(zookeeper: ZooKeeperServer) -> None:
    async with started_electors(zookeeper.connect_string, new_cluster(), 3) as electors:
        await wait_for(lambda: one_leader_agreed(electors), 5, "one leader")
        first = leaders(electors)[0]
        first_node = first.queue_node
        await first.leave()
        assert not first.is_leader()  # at once
        assert first.queue_node is None
        took_s = await wait_for(
            lambda: one_leader_agreed(electors) and not first.is_leader(), 1.0, "a new leader"
        )
        second = leaders(electors)[0]
        assert second is not first
        await first.join()
        assert first.queue_node is not None and first.queue_node != first_node
        await asyncio.sleep(0.3)
        assert not first.is_leader()  # back of the queue
        assert leaders(electors) == [second]
        assert took_s < 1.0


async def test_killed_leader_process_is_replaced(
    zookeeper: ZooKeeperServer, elector_process: ElectorProcessFactory, tmp_path: Path
) -> None:
    cluster = new_cluster()
    async with started_electors(zookeeper.connect_string, cluster, 2, join=False) as electors:
        process = elector_process(zookeeper.connect_string, cluster, "proc", SESSION_TIMEOUT_S)
        await wait_for(
            lambda: all((e.leader_info() or {}).get("broker_id") == "proc" for e in electors),
            20,
            f"the subprocess elector leads (its stderr is in {tmp_path})",
        )
        for elector in electors:
            await elector.join()
        await asyncio.sleep(0.2)
        assert leaders(electors) == []
        os.kill(process.pid, signal.SIGKILL)
        await asyncio.to_thread(process.wait, 10)
        took_s = await wait_for(
            lambda: one_leader_agreed(electors),
            SESSION_TIMEOUT_S + 2.0,
            "a new leader after kill -9",
        )
        assert leaders(electors)[0].broker_id == "b0"
        # The dead broker's advertisement went with its session.
        await wait_for(
            lambda: [b["broker_id"] for b in electors[1].brokers()] == ["b0", "b1"],
            1.0,
            "the dead broker is no longer listed",
        )
        assert took_s > 0.5  # it really waited for the session to expire


async def test_zookeeper_frozen_longer_than_session_timeout(
    zookeeper_factory: Callable[[], ZooKeeperServer],
) -> None:
    session_timeout_s = 2.0
    server = zookeeper_factory()
    statuses: dict[str, list[LeadershipStatus]] = {}

    def on_change(broker_id: str, status: LeadershipStatus) -> None:
        statuses.setdefault(broker_id, []).append(status)

    cluster = new_cluster()
    async with started_electors(
        server.connect_string,
        cluster,
        3,
        session_timeout_s=session_timeout_s,
        on_change=on_change,
    ) as electors:
        await wait_for(lambda: one_leader_agreed(electors), 5, "one leader")
        leader = leaders(electors)[0]
        old_nodes = [e.queue_node for e in electors]
        await asyncio.to_thread(server.pause)
        try:
            paused_at = time.monotonic()
            took_s = await wait_for(
                lambda: not leader.is_leader(),
                session_timeout_s * 2 / 3 + 1.0,
                "the leader stops leading on SUSPENDED",
            )
            # is_leader() reads kazoo's state directly; the callback follows on the loop.
            await wait_for(
                lambda: not statuses[leader.broker_id][-1].is_leader,
                0.5,
                "on_change reports the lost leadership",
            )
            assert not statuses[leader.broker_id][-1].connected
            # Stay frozen until every elector's own timer presumed its session lost.
            await wait_for(
                lambda: all(e.session_presumed_lost for e in electors),
                2 * session_timeout_s + 1.0,
                "sessions presumed lost",
            )
            while time.monotonic() - paused_at < 2 * session_timeout_s:
                assert leaders(electors) == []
                await asyncio.sleep(0.05)
        finally:
            await asyncio.to_thread(server.resume)
        old = {node for node in old_nodes if node is not None}

        def all_requeued() -> bool:
            # Connected again, each with a new queue node (sessions ended or presumed lost).
            nodes = {e.queue_node for e in electors}
            return all(e.connected for e in electors) and None not in nodes and not nodes & old

        await wait_for(
            lambda: all_requeued() and one_leader_agreed(electors),
            session_timeout_s + 8.0,
            "everybody re-queued with a new node, and one leader again",
        )
        await asyncio.sleep(0.3)
        assert len(leaders(electors)) == 1
        # No node of the old sessions is left behind, and every broker is advertised again.
        children = await queue_children(server.connect_string, cluster)
        assert sorted(children) == sorted(e.queue_node for e in electors if e.queue_node)
        await wait_for(
            lambda: all(len(e.brokers()) == 3 for e in electors), 2, "three brokers advertised"
        )
        assert len(await queue_children(server.connect_string, cluster, "brokers")) == 3
        assert took_s < session_timeout_s * 2 / 3 + 1.0


async def test_zookeeper_restart_keeps_one_leader(
    zookeeper_factory: Callable[[], ZooKeeperServer],
) -> None:
    server = zookeeper_factory()
    port, first_pid = server.port, server.pid
    async with started_electors(server.connect_string, new_cluster(), 3) as electors:
        await wait_for(lambda: one_leader_agreed(electors), 5, "one leader")
        # Server operations block: in a thread, so the electors keep running meanwhile.
        await asyncio.to_thread(server.stop)
        assert not server.is_running()
        with pytest.raises(OSError):
            await asyncio.to_thread(four_letter_word, server.host, port, "srvr", 1.0)
        await wait_for(lambda: leaders(electors) == [], 2, "no leader without ZooKeeper")
        await asyncio.to_thread(server.start)
        assert server.port == port and server.pid != first_pid
        assert "Mode: standalone" in await asyncio.to_thread(
            four_letter_word, server.host, port, "srvr"
        )
        await wait_for(lambda: one_leader_agreed(electors), SESSION_TIMEOUT_S + 8, "one leader")
        # restart() = stop + start on the same port and data.
        await asyncio.to_thread(server.restart)
        await wait_for(lambda: one_leader_agreed(electors), SESSION_TIMEOUT_S + 8, "one leader")
        await asyncio.sleep(0.5)
        assert len(leaders(electors)) == 1
