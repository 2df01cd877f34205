"""Code artifact replication (broker/ha/code_replication.py) against a real ZooKeeper server.

Three "brokers" share one in-memory Node (one log, so one applied entry stream) but each
has its own CodeStore, its own ZooKeeper session, its own CodeReplicator and its own
real ApiApp served by uvicorn, through which the others fetch artifacts. The leader's
CodeReplicaMonitor runs on the Node. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from broker.api.http_api import ApiApp, ApiConfig
from broker.artifacts.code_store import CodeStore
from broker.core import Applied, Artifact, TaskRef
from broker.core import entries as e
from broker.ha.code_replication import CodeReplicator, replica_path
from broker.leader.code_replicas import CodeReplicaMonitor
from broker.observability.node_observer import observe_node
from broker.replication.node import Node, NodeConfig
from clients.dev.zk import ZooKeeperServer
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore
from tests.support.asgi_server import Receive, Scope, Send, Served, serve, unserve
from tests.support.zk_clients import SESSION_TIMEOUT_S, close_client, start_client

WAIT_S = 15.0
JOB = b"def run(params):\n    return {'ok': True}\n"
JOB_SHA = hashlib.sha256(JOB).hexdigest()


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def wait_for_async(
    condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.02)


@dataclass
class Broker:
    broker_id: str
    store: CodeStore
    zk: KazooClient
    app: ApiApp
    served: Served
    replicator: CodeReplicator | None = None


@dataclass
class Cluster:
    name: str
    node: Node
    connect_string: str
    brokers: list[Broker] = field(default_factory=list)
    monitor: CodeReplicaMonitor | None = None
    # Monotonic times at which entries were applied, for the upload-to-ready figure.
    applied_at: dict[str, float] = field(default_factory=dict)

    def urls(self, but: str) -> list[str]:
        return [b.served.url for b in self.brokers if b.broker_id != but]

    def artifact(self, sha256: str = JOB_SHA) -> Artifact | None:
        return self.node.state.artifacts.get(sha256)

    def ready(self, sha256: str = JOB_SHA) -> bool:
        artifact = self.artifact(sha256)
        return artifact is not None and artifact.ready

    def replicator(
        self,
        index: int,
        *,
        listen: bool = True,
        sync_interval_s: float = 30.0,
        known: Callable[[], Iterable[str]] | None = None,
        peer_urls: Callable[[], list[str]] | None = None,
    ) -> CodeReplicator:
        broker = self.brokers[index]
        replicator = CodeReplicator(
            broker.store,
            broker.zk,
            self.name,
            broker.broker_id,
            peer_urls or (lambda: self.urls(broker.broker_id)),
            sync_interval_s=sync_interval_s,
            known_artifacts=known,
        )
        broker.replicator = replicator
        if listen:
            # In a real cluster each broker's own node calls it for the entries it applies.
            self.node.listeners.append(replicator.on_applied)
        return replicator

    async def upload(self, data: bytes = JOB, via: int = 0) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.brokers[via].served.url) as client:
            response = await client.post("/api/v1/code", params={"name": "job.py"}, content=data)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body


@pytest.fixture
async def cluster(zookeeper: ZooKeeperServer, tmp_path: Path) -> AsyncIterator[Cluster]:
    node = Node(
        NodeConfig(data_dir=tmp_path / "node", timer_poll_interval_s=0.05),
        ledgers=MemoryLedgerStore(),
        ledger_list=MemoryLedgerListStore(),
        snapshots=SnapshotStore(tmp_path / "node" / "snapshots"),
    )
    observe_node(node)
    await node.start()
    made = Cluster(f"code-{uuid.uuid4().hex[:8]}", node, zookeeper.connect_string)

    def timing(entry: e.Entry, applied: Applied) -> None:
        if isinstance(entry, e.AddCode) and not entry.ready:
            made.applied_at.setdefault(f"add:{entry.sha256}", time.monotonic())
        elif isinstance(entry, e.CodeReady):
            made.applied_at.setdefault(f"ready:{entry.sha256}", time.monotonic())

    node.listeners.append(timing)
    try:
        for index in range(3):
            store = CodeStore(tmp_path / f"b{index}" / "code")
            app = ApiApp(node, ApiConfig(min_code_replicas=3), code_store=store)
            made.brokers.append(
                Broker(
                    f"b{index}",
                    store,
                    await start_client(zookeeper.connect_string),
                    app,
                    await serve(app),
                )
            )
        yield made
    finally:
        if made.monitor is not None:
            await made.monitor.stop()
        for broker in made.brokers:
            if broker.replicator is not None:
                await broker.replicator.stop()
            await unserve(broker.served)
            await close_client(broker.zk)
        await node.stop(snapshot=False)
        await node.ledgers.close()


async def submit_with_code(node: Node, sha256: str = JOB_SHA) -> int:
    result = await node.propose(
        lambda stamp: e.SubmitTasks(
            time_ms=stamp.now_ms,
            tasks=tuple(
                e.TaskSpec(id=task_id, type="py", tenant="t", code=sha256)
                for task_id in stamp.task_ids(1)
            ),
        )
    )
    assert isinstance(result, list) and isinstance(result[0], TaskRef), result
    return result[0].id


# --- tests --------------------------------------------------------------------------------


async def test_upload_replicates_to_three_and_becomes_ready(cluster: Cluster) -> None:
    replicators = [cluster.replicator(i) for i in range(3)]
    for replicator in replicators:
        await replicator.start()
    cluster.monitor = CodeReplicaMonitor(
        cluster.node, cluster.brokers[0].zk, cluster.name, 3, 60_000
    )
    await cluster.monitor.start()

    body = await cluster.upload()
    assert body["sha256"] == JOB_SHA
    await wait_for(lambda: cluster.ready(), "the artifact became ready")
    elapsed_s = cluster.applied_at[f"ready:{JOB_SHA}"] - cluster.applied_at[f"add:{JOB_SHA}"]
    print(f"\nAddCode(ready=False) applied -> CodeReady applied: {elapsed_s * 1000:.1f} ms")
    assert elapsed_s < 3.0  # typically a few tens of ms; generous for a busy machine
    assert await replicators[1].replica_count(JOB_SHA) == 3
    for broker in cluster.brokers:
        assert broker.store.read(JOB_SHA) == JOB
        assert broker.replicator is not None and JOB_SHA in broker.replicator.registered
    exists = await asyncio.to_thread(
        cluster.brokers[0].zk.exists, replica_path(cluster.name, JOB_SHA, "b2")
    )
    assert exists is not None and exists.ephemeralOwner == cluster.brokers[2].zk.client_id[0]


async def test_tasks_wait_until_ready(cluster: Cluster) -> None:
    replicator = cluster.replicator(0)
    await replicator.start()
    await cluster.upload()
    assert not cluster.ready()
    task_id = await submit_with_code(cluster.node)
    state = cluster.node.state
    assert state.tasks[task_id].state == "waiting"
    assert task_id not in state.waiting.get("t", {})
    assert task_id in state.parked[JOB_SHA]
    # Only one replica of the three wanted: the other brokers come up late.
    cluster.monitor = CodeReplicaMonitor(
        cluster.node, cluster.brokers[0].zk, cluster.name, 3, 60_000
    )
    await cluster.monitor.start()
    await asyncio.sleep(0.3)
    assert not cluster.ready()
    for index in (1, 2):
        late = cluster.replicator(index, listen=False)
        await late.start()
        assert await late.fetch_missing([JOB_SHA], timeout_s=WAIT_S) == set()
    await wait_for(lambda: cluster.ready(), "ready once the late replicas registered")
    assert list(state.waiting["t"]) == [task_id]
    assert state.parked == {}


async def test_max_replication_wait_readies_with_too_few_replicas(cluster: Cluster) -> None:
    replicator = cluster.replicator(0)  # the only broker running a replicator
    await replicator.start()
    cluster.monitor = CodeReplicaMonitor(cluster.node, cluster.brokers[0].zk, cluster.name, 3, 400)
    await cluster.monitor.start()
    await cluster.upload()
    await wait_for(lambda: cluster.ready(), "ready after max_replication_wait")
    waited_s = cluster.applied_at[f"ready:{JOB_SHA}"] - cluster.applied_at[f"add:{JOB_SHA}"]
    print(f"\nready after {waited_s * 1000:.0f} ms with 1 replica (max wait 400 ms)")
    assert waited_s >= 0.35
    assert await replicator.replica_count(JOB_SHA) == 1


async def test_a_wait_of_minus_one_waits_for_the_replicas(cluster: Cluster) -> None:
    replicator = cluster.replicator(0)
    await replicator.start()
    cluster.monitor = CodeReplicaMonitor(cluster.node, cluster.brokers[0].zk, cluster.name, 2, -1)
    await cluster.monitor.start()
    await cluster.upload()
    await asyncio.sleep(1.0)  # 0 would have readied it at once; -1 never gives up alone
    assert not cluster.ready()
    late = cluster.replicator(1, listen=False)
    await late.start()
    assert await late.fetch_missing([JOB_SHA], timeout_s=WAIT_S) == set()
    await wait_for(lambda: cluster.ready(), "ready once the second replica registered")


def test_other_negative_waits_are_refused(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="or -1"):
        CodeReplicaMonitor(cluster.node, cluster.brokers[0].zk, cluster.name, 2, -2)


async def test_new_leaders_monitor_picks_up_unready_artifacts(cluster: Cluster) -> None:
    replicators = [cluster.replicator(i) for i in range(3)]
    for replicator in replicators:
        await replicator.start()
    await cluster.upload()  # no monitor yet: the leader died right after logging it
    await wait_for_async(lambda: _count_is(replicators[0], 3), "three replicas registered")
    assert not cluster.ready()
    cluster.monitor = CodeReplicaMonitor(
        cluster.node, cluster.brokers[1].zk, cluster.name, 3, 60_000
    )
    await cluster.monitor.start()
    await wait_for(lambda: cluster.ready(), "the new leader's monitor readied it", timeout_s=5)


async def test_safety_net_sync_fetches_a_missed_artifact(cluster: Cluster) -> None:
    for index in (0, 1):
        await cluster.replicator(index).start()
    missed = cluster.replicator(
        2,
        listen=False,  # its AddCode notification never comes
        sync_interval_s=0.3,
        known=lambda: cluster.node.state.artifacts.keys(),
    )
    await missed.start()
    cluster.monitor = CodeReplicaMonitor(
        cluster.node, cluster.brokers[0].zk, cluster.name, 3, 60_000
    )
    await cluster.monitor.start()
    await cluster.upload()
    took_s = await wait_for(lambda: cluster.brokers[2].store.has(JOB_SHA), "the sync fetched it")
    print(f"\nsafety-net sync fetched the missed artifact after {took_s * 1000:.0f} ms")
    await wait_for(lambda: cluster.ready(), "ready with the synced third replica")
    assert await missed.replica_count(JOB_SHA) == 3


async def test_replicas_registered_again_after_session_loss(cluster: Cluster) -> None:
    broker = cluster.brokers[0]
    await asyncio.to_thread(broker.store.put, JOB)  # on disk before the replicator starts
    replicator = cluster.replicator(0)
    await replicator.start()
    await wait_for_async(lambda: _count_is(replicator, 1), "registered at start")
    old_session = broker.zk.client_id[0]
    # Expire the session the way ZooKeeper does for a silent client: another connection
    # with the same session id closes it; the ephemeral znode goes with it.
    twin = KazooClient(
        hosts=cluster.connect_string, client_id=broker.zk.client_id, timeout=SESSION_TIMEOUT_S
    )
    await asyncio.to_thread(twin.start, 15)
    await close_client(twin)
    await wait_for(
        lambda: broker.zk.connected and broker.zk.client_id[0] != old_session,
        "kazoo reconnected with a new session",
    )
    await wait_for_async(lambda: _count_is(replicator, 1), "registered again")
    stat = await asyncio.to_thread(
        cluster.brokers[1].zk.exists, replica_path(cluster.name, JOB_SHA, "b0")
    )
    assert stat is not None and stat.ephemeralOwner == broker.zk.client_id[0]


async def test_wrong_bytes_from_a_peer_are_refused(cluster: Cluster) -> None:
    await cluster.replicator(0).start()
    await cluster.upload()

    async def liar(scope: Scope, receive: Receive, send: Send) -> None:
        body = b"print('not the artifact')\n"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    bad = await serve(liar)
    good = cluster.brokers[0].served.url
    try:
        fooled = cluster.replicator(1, listen=False, peer_urls=lambda: [bad.url])
        await fooled.start()
        assert await fooled.fetch_missing([JOB_SHA], timeout_s=WAIT_S) == {JOB_SHA}
        assert not cluster.brokers[1].store.has(JOB_SHA)
        await fooled.stop()
        helped = cluster.replicator(2, listen=False, peer_urls=lambda: [bad.url, good])
        await helped.start()
        assert await helped.fetch_missing([JOB_SHA], timeout_s=WAIT_S) == set()
        assert cluster.brokers[2].store.read(JOB_SHA) == JOB
    finally:
        await unserve(bad)


async def _count_is(replicator: CodeReplicator, count: int) -> bool:
    return await replicator.replica_count(JOB_SHA) == count
