"""The pulsar ledger backend against a real pulsar-lite: what the contract suite does not
cover (tests/unit/test_ledger_contract.py runs the contract itself on pulsar-lite).

The launcher binds loopback only; acknowledged appends survive kill -9 of the broker and the
writer and readers carry on after its restart; a failed send fails every later append;
readers drop duplicates and gaps the same way; the ZooKeeper id allocator; the namespace
policy check and topic deletion through the admin REST API (no admin API here: checked on the
requests sent). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pulsar  # type: ignore[import-untyped]
import pytest
from kazoo.client import KazooClient  # type: ignore[import-untyped]

import log.pulsar
import log.pulsar.reader
from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.zk import ZooKeeperServer
from log.api import LedgerError, LedgerReader, NoSuchLedgerError
from log.pulsar import (
    Kind,
    PulsarConfig,
    PulsarLedgerReader,
    PulsarLedgerStore,
    PulsarPolicyError,
    encode_entries,
    encode_message,
)
from log.zk_list import ZooKeeperLedgerIdAllocator
from tests.support.listening import listening_addresses

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def new_cluster() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def counter_ids() -> Callable[[], Awaitable[int]]:
    """An in-process allocator (one test, one topic prefix: ids cannot collide)."""
    counter = itertools.count(1)

    async def allocate() -> int:
        return next(counter)

    return allocate


def lite_config(server: PulsarLiteServer, cluster: str, **overrides: object) -> PulsarConfig:
    options: dict[str, object] = {
        "tenant": "steward",
        "namespace": "tests",
        "cluster": cluster,
        "operation_timeout_s": 5.0,
    }
    options.update(overrides)
    return PulsarConfig.for_pulsar_lite(server.service_url, **options)


@pytest.fixture
async def stores() -> AsyncIterator[list[PulsarLedgerStore]]:
    """Stores a test creates; all closed after it."""
    created: list[PulsarLedgerStore] = []
    yield created
    for store in created:
        await asyncio.wait_for(store.close(), WAIT_S)


async def read_all(reader: LedgerReader) -> list[bytes]:
    entries = await reader.read(0, 100_000)
    assert [e.entry_id for e in entries] == list(range(len(entries)))
    return [e.data for e in entries]


# -- the launcher ------------------------------------------------------------------------------


def test_launcher_listens_on_loopback_only(pulsar_lite: PulsarLiteServer) -> None:
    assert pulsar_lite.pid is not None
    # No metrics endpoint on 0.0.0.0:8080: only the broker port, on loopback.
    assert listening_addresses(pulsar_lite.pid) == [f"127.0.0.1:{pulsar_lite.port}"]
    assert pulsar_lite.service_url == f"pulsar://127.0.0.1:{pulsar_lite.port}"
    assert "enabled = false" in pulsar_lite.config_path.read_text()


def test_launcher_restarts_on_the_same_port_and_data(tmp_path: Path) -> None:
    server = PulsarLiteServer(tmp_path / "lite", stop_with_parent=True)
    server.start()
    try:
        port, first_pid = server.port, server.pid
        server.kill()
        assert not server.is_running()
        server.start()
        assert server.port == port and server.pid != first_pid
        server.restart()
        assert server.is_running() and server.port == port
    finally:
        server.stop()
    assert not server.is_running()
    assert server.log_path.exists()


# -- writers and readers across a broker crash ------------------------------------------------


async def test_acknowledged_appends_survive_kill_9_and_clients_carry_on(
    pulsar_lite_factory: Callable[[], PulsarLiteServer], stores: list[PulsarLedgerStore]
) -> None:
    server = pulsar_lite_factory()
    cluster = new_cluster()
    ids = counter_ids()
    writer_store = PulsarLedgerStore(lite_config(server, cluster), ids)
    reader_store = PulsarLedgerStore(lite_config(server, cluster), ids)
    stores += [writer_store, reader_store]
    writer = await writer_store.create_ledger()
    tailing = await reader_store.open_ledger(writer.ledger_id, recovery=False)
    acknowledged = [await writer.append(b"before-%d" % i) for i in range(50)]
    assert acknowledged == list(range(50))

    server.kill()
    server.start()
    # The client reconnects by itself; the writer and the reader go on where they were.
    after = await asyncio.wait_for(
        asyncio.gather(*(writer.append(b"after-%d" % i) for i in range(50))), WAIT_S
    )
    assert after == list(range(50, 100))
    assert await tailing.wait_for_entries(98, WAIT_S)
    assert len(await tailing.read(0, 200)) == 100

    server.kill()
    server.start()
    recovering = PulsarLedgerStore(lite_config(server, cluster), ids)
    stores.append(recovering)
    recovered = await recovering.open_ledger(writer.ledger_id, recovery=True)
    assert recovered.last_entry_id == 99
    expected = [b"before-%d" % i for i in range(50)] + [b"after-%d" % i for i in range(50)]
    assert await read_all(recovered) == expected


async def test_failed_send_fails_that_append_and_every_later_one(
    pulsar_lite_factory: Callable[[], PulsarLiteServer], stores: list[PulsarLedgerStore]
) -> None:
    server = pulsar_lite_factory()
    cluster = new_cluster()
    ids = counter_ids()
    store = PulsarLedgerStore(lite_config(server, cluster, send_timeout_ms=1000), ids)
    stores.append(store)
    writer = await store.create_ledger()
    assert [await writer.append(b"%d" % i) for i in range(3)] == [0, 1, 2]
    server.kill()
    with pytest.raises(LedgerError):
        await asyncio.wait_for(writer.append(b"lost"), WAIT_S)
    server.start()
    # Dead for good, also once the broker is back: a later success would leave a hole.
    with pytest.raises(LedgerError):
        await asyncio.wait_for(writer.append(b"later"), WAIT_S)
    assert writer.last_add_confirmed == 2
    recovering = PulsarLedgerStore(lite_config(server, cluster), ids)
    stores.append(recovering)
    reader = await recovering.open_ledger(writer.ledger_id, recovery=True)
    assert reader.last_entry_id is not None and reader.last_entry_id >= 2
    assert (await read_all(reader))[:3] == [b"0", b"1", b"2"]


async def test_appends_beyond_max_pending_sends_wait_and_keep_order(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    # Messages of at most 2 entries, at most 3 of them unacknowledged: most appends wait.
    config = lite_config(pulsar_lite, new_cluster(), max_pending_sends=3, max_message_bytes=6)
    store = PulsarLedgerStore(config, counter_ids())
    stores.append(store)
    writer = await store.create_ledger()
    futures = [writer.append(b"%03d" % i) for i in range(300)]
    assert await asyncio.wait_for(asyncio.gather(*futures), WAIT_S) == list(range(300))
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    entries = await reader.read(0, 300)
    assert [e.data for e in entries] == [b"%03d" % i for i in range(300)]
    lacs = [e.last_add_confirmed for e in entries]
    assert lacs == sorted(lacs)
    # 150 messages, a new one sent only when at most 2 others are unacknowledged: the LAC
    # moves at least every third message.
    assert len(set(lacs)) >= 40
    assert all(e.last_add_confirmed < e.entry_id for e in entries)


async def test_fencing_check_tells_pulsar_lite_does_not_fence(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    cluster = new_cluster()
    plain = PulsarLedgerStore(lite_config(pulsar_lite, cluster), counter_ids())
    claiming = PulsarLedgerStore(lite_config(pulsar_lite, cluster, fencing=True), counter_ids())
    stores += [plain, claiming]
    assert not plain.can_fence and claiming.can_fence
    assert await plain.verify_fencing("test") is False
    with pytest.raises(LedgerError, match="does not enforce ExclusiveWithFencing"):
        await claiming.verify_fencing("test")


# -- the reader's rules -------------------------------------------------------------------------


async def test_readers_drop_duplicates_and_gaps_and_stop_at_the_first_seal(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    cluster = new_cluster()
    config = lite_config(pulsar_lite, cluster)
    ledger_id = 7
    # What a failing writer and its resends could leave behind, written raw.
    stored = [
        encode_message(Kind.CREATED, ledger_id, -1),
        encode_entries(0, -1, [b"a"]),
        encode_entries(1, 0, [b"b"]),
        encode_entries(1, 0, [b"b-resent"]),
        encode_entries(0, -1, [b"a-resent"]),
        encode_entries(3, 1, [b"d-after-a-hole"]),
        encode_entries(2, 1, [b"c", b"d"]),  # one message, two entries
        encode_entries(3, 1, [b"d-resent", b"e"]),  # overlaps: only e is new
        encode_message(Kind.SEAL, -1, -1),
        encode_entries(5, 2, [b"f-after-the-seal"]),
        encode_message(Kind.SEAL, -1, -1),
    ]
    client = pulsar.Client(
        config.service_url, operation_timeout_seconds=5, logger=log.pulsar.CLIENT_LOGGER
    )
    try:
        producer = client.create_producer(config.topic(ledger_id), batching_enabled=False)
        for payload in stored:
            producer.send(payload)
    finally:
        client.close()

    store = PulsarLedgerStore(config, counter_ids())
    stores.append(store)
    tailing = await store.open_ledger(ledger_id, recovery=False)
    assert [(e.entry_id, e.data, e.last_add_confirmed) for e in await tailing.read(0, 10)] == [
        (0, b"a", -1),
        (1, b"b", 0),
        (2, b"c", 1),
        (3, b"d", 1),
        (4, b"e", 1),
    ]
    assert not await tailing.wait_for_entries(4, 0.05)
    # The hole made the reader start over from its last accepted message.
    assert isinstance(tailing, PulsarLedgerReader) and tailing.recreations >= 1
    recovered = await store.open_ledger(ledger_id, recovery=True)
    assert recovered.last_entry_id == 4
    assert await read_all(recovered) == [b"a", b"b", b"c", b"d", b"e"]


async def test_reader_buffer_budget_pauses_and_rewinds(
    pulsar_lite: PulsarLiteServer,
    stores: list[PulsarLedgerStore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(log.pulsar.reader, "READER_BUFFER_BYTES", 40)
    store = PulsarLedgerStore(lite_config(pulsar_lite, new_cluster()), counter_ids())
    stores.append(store)
    writer = await store.create_ledger()
    expected = [b"entry-%03d" % i for i in range(120)]
    await asyncio.gather(*(writer.append(data) for data in expected))
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    got: list[bytes] = []
    while len(got) < len(expected):
        # The reader stops fetching past its budget and forgets what was read.
        batch = await asyncio.wait_for(reader.read(len(got), 3), WAIT_S)
        assert batch, f"stuck after {len(got)} entries"
        got += [e.data for e in batch]
    assert got == expected
    assert isinstance(reader, PulsarLedgerReader)
    recreations = reader.recreations  # 0 unless the machine is so busy a reader stalled
    # Before what the buffer still holds: the reader starts over from the first message.
    assert [e.data for e in await reader.read(3, 2)] == expected[3:5]
    assert reader.recreations >= recreations + 1


async def test_unknown_ledger_without_catalog(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    store = PulsarLedgerStore(
        lite_config(pulsar_lite, new_cluster(), open_wait_s=0.3), counter_ids()
    )
    stores.append(store)
    with pytest.raises(NoSuchLedgerError):
        await store.open_ledger(5, recovery=True)
    writer = await store.create_ledger()
    await writer.append(b"x")
    # Another store without a catalog: the CREATED marker tells the ledger exists.
    other = PulsarLedgerStore(lite_config(pulsar_lite, store.config.cluster), counter_ids())
    stores.append(other)
    reader = await other.open_ledger(writer.ledger_id, recovery=False)
    assert await read_all(reader) == [b"x"]
    assert await store.list_ledgers() == [writer.ledger_id]
    assert await other.list_ledgers() == []  # no catalog, no admin API: knows nothing
    await store.delete_ledger(writer.ledger_id)
    with pytest.raises(NoSuchLedgerError):
        await reader.read(0, 10)  # the DELETED marker reached the other store's reader


# -- ledger ids in ZooKeeper ----------------------------------------------------------------


async def test_zookeeper_ids_increase_across_brokers_and_restarts(
    zookeeper: ZooKeeperServer,
) -> None:
    cluster = new_cluster()
    clients = [KazooClient(hosts=zookeeper.connect_string) for _ in range(2)]
    for client in clients:
        client.start(timeout=15)
    try:
        first, second = (ZooKeeperLedgerIdAllocator(c, cluster) for c in clients)
        ids = [await first(), await second(), await first(), await second()]
        assert ids == sorted(set(ids)) and ids[0] >= 1
        assert await first.list_ids() == ids
        assert await second.exists(ids[1]) and not await second.exists(ids[-1] + 1)
        await second.remove(ids[1])
        await second.remove(ids[1])  # idempotent
        assert not await first.exists(ids[1])
        assert await first.list_ids() == [ids[0], *ids[2:]]
        clients[0].stop()
        clients[0].close()
        clients[0] = KazooClient(hosts=zookeeper.connect_string)
        clients[0].start(timeout=15)
        restarted = ZooKeeperLedgerIdAllocator(clients[0], cluster)
        assert await restarted() > ids[-1]  # never reuses an id, also after a removal
        clients[1].stop()
        with pytest.raises(LedgerError):
            await second()  # not connected: fails at once
    finally:
        for client in clients:
            client.stop()
            client.close()


# -- the admin REST API (none in pulsar-lite: the requests are checked) --------------------


class AdminRecorder:
    """Answers admin requests like Pulsar does and records them."""

    def __init__(self, policies: dict[str, object], refuse_writes: bool = False) -> None:
        self.cluster = new_cluster()
        self.policies = policies
        self.refuse_writes = refuse_writes
        self.requests: list[tuple[str, str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        assert request.headers.get("authorization") == "Bearer secret"
        if request.method == "GET" and request.url.path.startswith("/admin/v2/namespaces/"):
            return httpx.Response(200, json=self.policies)
        if request.method == "GET":
            return httpx.Response(
                200,
                json=[
                    f"persistent://tenant1/ns1/{self.cluster}-ledger-000000000004",
                    "persistent://tenant1/ns1/unrelated-topic",
                ],
            )
        if self.refuse_writes:
            return httpx.Response(403, json={"reason": "Not authorized"})
        return httpx.Response(204)


def admin_store(server: PulsarLiteServer, recorder: AdminRecorder) -> PulsarLedgerStore:
    config = PulsarConfig.for_pulsar_lite(
        server.service_url,
        admin_url="http://admin.invalid:8080",
        tenant="tenant1",
        namespace="ns1",
        cluster=recorder.cluster,
        auth_token="secret",
        operation_timeout_s=5.0,
    )
    return PulsarLedgerStore(config, counter_ids(), admin_transport=httpx.MockTransport(recorder))


async def test_namespace_retention_is_applied_when_missing(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    recorder = AdminRecorder({"retention_policies": None})
    store = admin_store(pulsar_lite, recorder)
    stores.append(store)
    await store.ensure_namespace_retention()
    base = "/admin/v2/namespaces/tenant1/ns1"
    assert recorder.requests == [
        ("GET", base, None),
        ("POST", f"{base}/retention", {"retentionTimeInMinutes": -1, "retentionSizeInMB": -1}),
        (
            "POST",
            f"{base}/inactiveTopicPolicies",
            {
                "inactiveTopicDeleteMode": "delete_when_no_subscriptions",
                "maxInactiveDurationSeconds": 3600,
                "deleteWhileInactive": False,
            },
        ),
    ]


async def test_namespace_retention_already_right_changes_nothing(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    recorder = AdminRecorder(
        {
            "retention_policies": {"retentionTimeInMinutes": -1, "retentionSizeInMB": -1},
            "inactive_topic_policies": {"deleteWhileInactive": False},
        }
    )
    store = admin_store(pulsar_lite, recorder)
    stores.append(store)
    await store.ensure_namespace_retention()
    assert [method for method, _, _ in recorder.requests] == ["GET"]


async def test_namespace_retention_refused_is_a_clear_error(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    store = admin_store(pulsar_lite, AdminRecorder({}, refuse_writes=True))
    stores.append(store)
    with pytest.raises(PulsarPolicyError, match=r"refused \(403"):
        await store.ensure_namespace_retention()
    without_admin = PulsarLedgerStore(lite_config(pulsar_lite, new_cluster()), counter_ids())
    stores.append(without_admin)
    await without_admin.ensure_namespace_retention()  # a no-op (logged)


async def test_delete_and_list_go_through_the_admin_api(
    pulsar_lite: PulsarLiteServer, stores: list[PulsarLedgerStore]
) -> None:
    recorder = AdminRecorder({})
    store = admin_store(pulsar_lite, recorder)
    stores.append(store)
    writer = await store.create_ledger()
    await writer.append(b"x")
    assert await store.list_ledgers() == [writer.ledger_id, 4]
    await store.delete_ledger(writer.ledger_id)
    assert (
        "DELETE",
        f"/admin/v2/persistent/tenant1/ns1/{recorder.cluster}-ledger-{writer.ledger_id:012d}",
        None,
    ) in recorder.requests
    assert await store.list_ledgers() == [4]


def test_broker_refuses_the_fencing_setting_on_pulsar_lite(
    pulsar_lite: PulsarLiteServer, zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    # `--pulsar-flavor pulsar` (the default: Apache Pulsar, fencing on) against pulsar-lite,
    # which does not enforce ExclusiveWithFencing: the broker must not start believing its
    # ledgers are fenced; it says so and exits 2.
    import subprocess

    from tests.support.procs import free_port, steward_command

    result = subprocess.run(
        [
            *steward_command(),
            "broker",
            "--zookeeper",
            zookeeper.connect_string,
            "--cluster",
            f"f{uuid.uuid4().hex[:8]}",
            "--broker-id",
            "b0",
            "--data-dir",
            str(tmp_path / "b0"),
            "--http",
            f"127.0.0.1:{free_port()}",
            "--ledgers",
            "pulsar",
            "--pulsar-url",
            pulsar_lite.service_url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("steward: cannot start:"), last
    assert "does not enforce ExclusiveWithFencing" in last, last
    assert "Traceback" not in result.stderr
