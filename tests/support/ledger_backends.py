"""Backends for the ledger contract tests (tests/support/ledger_contract.py).

A backend hands out any number of stores (and ledger-list stores) over the *same*
storage, so tests can restart a store, or fence a writer from a second store. To run the
contract against another backend, subclass :class:`LedgerBackend` and add it to
:data:`BACKENDS`; a backend that needs pytest fixtures (a server) names them in
``fixtures`` and gets them as keyword arguments.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from kazoo.client import KazooClient  # type: ignore[import-untyped]

from broker.observability.node_observer import observe_node
from broker.replication.node import Node, NodeConfig
from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.pulsar_standalone import PulsarStandalone
from clients.dev.zk import ZooKeeperServer
from log.api import LedgerListStore, LedgerStore
from log.file import FileLedgerListStore, FileLedgerStore
from log.memory import MemoryLedgerCluster, MemoryLedgerListStore, MemoryLedgerStore
from log.pulsar import PulsarConfig, PulsarLedgerStore
from log.zk_list import ZooKeeperLedgerIdAllocator, ZooKeeperLedgerListStore, ledger_list_path
from snapshot.store import SnapshotStore

ZK_CONNECT_TIMEOUT_S = 15.0


class LedgerBackend(ABC):
    #: Names of the pytest fixtures the constructor takes as keyword arguments.
    fixtures: ClassVar[tuple[str, ...]] = ()
    #: Whether its stores fence a deposed writer (``LedgerStore.can_fence``).
    fences: ClassVar[bool] = True

    def __init__(self, tmp_path: Path, **fixtures: Any) -> None:
        self.tmp_path = tmp_path
        self._stores: list[LedgerStore] = []

    def new_store(self) -> LedgerStore:
        """A new store over this backend's storage (a "restart" when the old one is closed)."""
        store = self._make_store()
        self._stores.append(store)
        return store

    @abstractmethod
    def _make_store(self) -> LedgerStore: ...

    @abstractmethod
    def new_list_store(self) -> LedgerListStore:
        """A ledger-list store over this backend's one ledger list."""

    async def close(self) -> None:
        for store in self._stores:
            await store.close()


class MemoryBackend(LedgerBackend):
    def __init__(self, tmp_path: Path, **fixtures: Any) -> None:
        super().__init__(tmp_path)
        self.cluster = MemoryLedgerCluster()
        self.list_store = MemoryLedgerListStore()

    def _make_store(self) -> LedgerStore:
        return MemoryLedgerStore(self.cluster)

    def new_list_store(self) -> LedgerListStore:
        return self.list_store


class FileBackend(LedgerBackend):
    def _make_store(self) -> LedgerStore:
        return FileLedgerStore(self.tmp_path / "ledgers")

    def new_list_store(self) -> LedgerListStore:
        return FileLedgerListStore(self.tmp_path / "ledgers.json")


class PulsarZooKeeperBackend(LedgerBackend):
    """A Pulsar server with ledger ids and the ledger list in ZooKeeper, the way a cluster
    runs it: stores in other processes share them (``config.cluster`` names the topics and
    the znodes)."""

    def __init__(self, tmp_path: Path, config: PulsarConfig, zookeeper_connect: str) -> None:
        super().__init__(tmp_path)
        self.config = config
        self.cluster = config.cluster
        self.zk = KazooClient(hosts=zookeeper_connect, timeout=4.0)
        self.zk.start(timeout=ZK_CONNECT_TIMEOUT_S)

    def _make_store(self) -> LedgerStore:
        return PulsarLedgerStore(self.config, ZooKeeperLedgerIdAllocator(self.zk, self.cluster))

    def new_list_store(self) -> LedgerListStore:
        return ZooKeeperLedgerListStore(self.zk, ledger_list_path(self.cluster))

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self.zk.stop()
            self.zk.close()


class PulsarBackend(PulsarZooKeeperBackend):
    """pulsar-lite (one per session) with ledger ids and the ledger list in ZooKeeper; every
    test gets its own cluster name (topics, znodes), so tests sharing the servers never meet."""

    # pulsar-lite 0.2.0 ignores producer access modes (no ExclusiveWithFencing), so its
    # stores cannot fence (PulsarConfig.fencing is False there): the ZooKeeper check of
    # docs/DESIGN.md §4 protects acknowledged writes instead, and recovery's SEAL keeps a deposed
    # writer's late appends from every reader (assert_recovered_end_is_final).
    fixtures = ("pulsar_lite", "zookeeper")
    fences = False

    def __init__(
        self, tmp_path: Path, *, pulsar_lite: PulsarLiteServer, zookeeper: ZooKeeperServer
    ) -> None:
        config = pulsar_lite_config(pulsar_lite, f"t{uuid.uuid4().hex[:12]}")
        super().__init__(tmp_path, config, zookeeper.connect_string)


def pulsar_lite_config(server: PulsarLiteServer, cluster: str) -> PulsarConfig:
    """``PulsarConfig.for_pulsar_lite`` as the tests use it (bounded operations)."""
    return PulsarConfig.for_pulsar_lite(
        server.service_url,
        tenant="steward",
        namespace="tests",
        cluster=cluster,
        operation_timeout_s=10.0,
        send_timeout_ms=10_000,
    )


def apache_pulsar_config(server: PulsarStandalone, cluster: str) -> PulsarConfig:
    """``PulsarConfig.for_apache_pulsar`` as the tests use it (bounded operations)."""
    return PulsarConfig.for_apache_pulsar(
        server.service_url,
        server.admin_url,
        cluster=cluster,
        operation_timeout_s=10.0,
        send_timeout_ms=10_000,
    )


class MemoryLedgerIds:
    """Ledger ids and their catalog (``LedgerCatalog``) in memory, shared by the stores of
    one backend: :class:`PulsarMemoryListBackend` runs without a ZooKeeper JVM beside Pulsar."""

    def __init__(self) -> None:
        self._last = 0
        self._ids: set[int] = set()

    async def __call__(self) -> int:
        self._last += 1
        self._ids.add(self._last)
        return self._last

    async def exists(self, ledger_id: int) -> bool:
        return ledger_id in self._ids

    async def list_ids(self) -> list[int]:
        return sorted(self._ids)

    async def remove(self, ledger_id: int) -> None:
        self._ids.discard(ledger_id)


class PulsarMemoryListBackend(LedgerBackend):
    """A Pulsar server with ledger ids, catalog and ledger list in memory, shared by the
    stores of one backend (no ZooKeeper JVM beside the server): for in-process nodes."""

    def __init__(self, tmp_path: Path, config: PulsarConfig) -> None:
        super().__init__(tmp_path)
        self.config = config
        self.ids = MemoryLedgerIds()
        self.list_store = MemoryLedgerListStore()

    def _make_store(self) -> LedgerStore:
        return PulsarLedgerStore(self.config, self.ids)

    def new_list_store(self) -> LedgerListStore:
        return self.list_store


class ApachePulsarBackend(PulsarMemoryListBackend):
    """Real Apache Pulsar (a standalone JVM: clients/dev/pulsar_standalone.py) with
    ``PulsarConfig.for_apache_pulsar`` (ExclusiveWithFencing, the admin API, its measured
    defaults). Not in :data:`BACKENDS`: a JVM belongs in a real-process test module, so the
    contract runs on it from tests/integration/test_ledger_real_pulsar.py, which gives the
    ``pulsar_standalone`` fixture (one standalone per module; docs/TESTING.md, "Real Apache
    Pulsar")."""

    fixtures = ("pulsar_standalone",)
    fences = True

    def __init__(self, tmp_path: Path, *, pulsar_standalone: PulsarStandalone) -> None:
        super().__init__(
            tmp_path, apache_pulsar_config(pulsar_standalone, f"t{uuid.uuid4().hex[:12]}")
        )


BACKENDS: dict[str, type[LedgerBackend]] = {
    "memory": MemoryBackend,
    "file": FileBackend,
    "pulsar": PulsarBackend,
}


def cluster_node(
    backend: LedgerBackend,
    tmp_path: Path,
    name: str,
    cluster_id: str,
    *,
    zookeeper_confirmation: bool = True,
) -> Node:
    """A cluster-mode Node over ``backend`` (timers and snapshots out of the way) whose
    elector view always says it leads: only the ledgers and the ledger list can depose it.

    ``zookeeper_confirmation=False`` is a TEST-ONLY switch (it exists nowhere else): it
    takes Steward's own ZooKeeper confirmation out of the way, so that only the ledger
    engine can stop a deposed leader (tests/integration/test_ledger_real_pulsar.py). The
    node's store is then treated as one that fences (``can_fence`` forced True), so its
    leader neither confirms each durable batch in ZooKeeper nor caps the LAC it stamps
    (docs/DESIGN.md §4); with the stale elector view above, nothing of Steward's checks
    whether it still leads. On a backend that really fences that changes nothing; on
    pulsar-lite it leaves the late appends of a deposed leader unguarded.
    """
    ledgers = backend.new_store()
    if not zookeeper_confirmation:
        ledgers.can_fence = True
    node = Node(
        NodeConfig(
            data_dir=tmp_path / name,
            broker_id=name,
            cluster_id=cluster_id,
            snapshot_interval_s=3600.0,
            timer_poll_interval_s=3600.0,
        ),
        ledgers=ledgers,
        ledger_list=backend.new_list_store(),
        snapshots=SnapshotStore(tmp_path / name / "snapshots"),
    )
    observe_node(node)
    node.leadership_check = lambda: True
    return node
