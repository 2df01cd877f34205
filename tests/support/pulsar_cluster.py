"""A real Apache Pulsar cluster for tests (issue 31, 1b): a 3-server ZooKeeper ensemble, three
bookies and one or two brokers, each a JVM of its own on 127.0.0.1, from the engines cache
(tests/engines/pom.xml; docs/TESTING.md, "A real Pulsar cluster").

What runs, in start order (everything under the cluster's directory, one sub-directory each):

- **ZooKeeper**: the 3-server ensemble of tests/support/zk_ensemble.py
  (:class:`~tests.support.zk_ensemble.ZooKeeperEnsemble`, ``QuorumPeerMain`` on the engines
  cache's own ZooKeeper 3.9 jars) holds the brokers' and the bookies' metadata; every
  broker, bookie and the metadata set-up is given all three members, so the cluster lives
  through the loss of any one (tests/integration/test_pulsar_cluster_faults.py kills one).
- **Cluster metadata**: ``org.apache.pulsar.PulsarClusterMetadataSetup`` once, bounded by
  :data:`SETUP_TIMEOUT_S`; it writes the Pulsar cluster's metadata (cluster, ``public/default``)
  and formats BookKeeper's (``/ledgers``, the instance id the bookies check at start).
- **Bookies**: :data:`BOOKIES` ``org.apache.bookkeeper.server.Main`` JVMs (:class:`Bookie`):
  on 127.0.0.1 (``listeningInterface=lo``, ``allowLoopback=true``), ``journalSyncData=true``,
  DbLedgerStorage with small caches. Ready: the bookie port accepts connections (BookKeeper
  registers the bookie before it opens the port).
- **Brokers**: one or two ``org.apache.pulsar.PulsarBrokerStarter`` JVMs (:class:`Broker`),
  ``managedLedgerDefaultEnsembleSize``/``WriteQuorum``/``AckQuorum`` from the cluster's
  :class:`Quorums`, load shedding off (a topic moves only when a test moves it). Ready: the
  admin health check (``/admin/v2/brokers/health``, a write and read on a heartbeat topic)
  answers ``ok``.

The quorums: a bookie failure is survived by an *ensemble change*, the BookKeeper client
replacing the failed bookie in the ledger's ensemble by one outside it, so the ensemble must
be smaller than the number of bookies. :data:`DEFAULT_QUORUMS` is ensemble 2, write and ack
quorum 2 on three bookies: every entry on two bookies, both acknowledge, one spare. With an
ensemble of 3 on three bookies there is no spare and, with an ack quorum of 2, writes stop
once the dead bookie's ZooKeeper session expired (the bookie test of
tests/integration/test_pulsar_cluster_faults.py passes with the first and fails with the
second).

Every JVM runs in a process group of its own (tests/support/pulsar_cluster_members.py: a
``GroupJvmProcess`` of the standalone harness, whose JVM flags and engines lookup it shares
too; the ensemble's members are signalled by pid); the kernel sends each SIGTERM when the
thread that started it ends, :meth:`PulsarCluster.close` kills every JVM and gives the
reserved ports back (tests/support/reserved_ports.py; kept across
restarts, so a restarted member has its old address). A missing jar or Java raises at
construction, saying what to run. The first start of each member is bounded and measured,
later starts by a multiple of it (as the standalone's); a failed start raises with the tail
of the member's log.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import pytest
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from clients.dev.engine_jvm import find_java_or_fail, jvm_command
from clients.dev.local_server import HOST
from clients.dev.pulsar_standalone import engines_lib, pulsar_version
from clients.dev.zk import LOG4J2_CONSOLE_CONFIG, ZooKeeperError
from tests.support.pulsar_cluster_members import (
    CLUSTER_NAME,
    JVM_OPTIONS,
    SESSION_TIMEOUT_MS,
    Bookie,
    Broker,
    ClusterMember,
    PulsarClusterError,
    Quorums,
)
from tests.support.zk_ensemble import ZooKeeperEnsemble

__all__ = [
    "BOOKIES",
    "CLUSTER_NAME",
    "DEFAULT_QUORUMS",
    "Bookie",
    "Broker",
    "ClusterMember",
    "PulsarCluster",
    "PulsarClusterError",
    "Quorums",
    "started_cluster",
]

BOOKIES = 3
#: Bound of PulsarClusterMetadataSetup (a JVM that connects to ZooKeeper and exits).
SETUP_TIMEOUT_S = 120.0
#: Bound of a wait for the whole cluster to answer health checks again.
HEALTHY_TIMEOUT_S = 120.0
#: Ensemble 2, write and ack quorum 2 on three bookies (the module docstring says why).
DEFAULT_QUORUMS = Quorums(ensemble=2, write=2, ack=2)
_SETUP_MAIN_CLASS = "org.apache.pulsar.PulsarClusterMetadataSetup"
_ENSEMBLES_RE = re.compile(r"ensembles=\{(.*?\])\}")
_ENSEMBLE_RE = re.compile(r"\d+=\[([^\]]*)\]")


class PulsarCluster:
    """A ZooKeeper ensemble, :data:`BOOKIES` bookies and ``brokers`` brokers on 127.0.0.1 in
    ``directory``.

    Use it as a context manager (or call :meth:`start` and :meth:`close`): whatever happens,
    :meth:`close` kills every JVM's process group and gives the ports back.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        brokers: int = 2,
        quorums: Quorums = DEFAULT_QUORUMS,
    ) -> None:
        if brokers not in (1, 2):
            raise ValueError(f"one or two brokers, not {brokers}")
        if quorums.ensemble > BOOKIES:
            raise ValueError(f"an ensemble of {quorums.ensemble} needs that many bookies")
        self._directory = Path(directory).resolve()
        self._directory.mkdir(parents=True, exist_ok=True)
        self.version = pulsar_version()
        self._lib = engines_lib()
        self._java = find_java_or_fail(PulsarClusterError)
        self.quorums = quorums
        self.zookeeper: ZooKeeperEnsemble | None = None
        self.bookies: list[Bookie] = []
        self.brokers: list[Broker] = []
        try:
            self.zookeeper = ZooKeeperEnsemble(
                self._directory / "zookeeper",
                max_session_timeout_ms=4 * SESSION_TIMEOUT_MS,
                classpath=str(self._lib / "*"),
                java=self._java,
            )
            connect = self.zookeeper.connect_string
            for index in range(BOOKIES):
                self.bookies.append(
                    Bookie(
                        self._directory / f"bookie-{index}",
                        name=f"bookie-{index}",
                        zookeeper_connect=connect,
                    )
                )
            for index in range(brokers):
                self.brokers.append(
                    Broker(
                        self._directory / f"broker-{index}",
                        name=f"broker-{index}",
                        zookeeper_connect=connect,
                        quorums=quorums,
                    )
                )
        except BaseException:
            self.close()
            raise
        #: Measured: launch of ZooKeeper to every broker healthy, seconds.
        self.start_s: float | None = None
        #: Measured: launch of the ZooKeeper ensemble to all three members serving, seconds.
        self.zookeeper_start_s: float | None = None

    # -- addresses ----------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def service_url(self) -> str:
        """Every broker's address (``pulsar://127.0.0.1:A,127.0.0.1:B``): a client whose first
        broker is down looks topics up on the next."""
        return f"pulsar://{','.join(broker.address for broker in self.brokers)}"

    @property
    def admin_url(self) -> str:
        """The admin API of the first running broker."""
        for broker in self.brokers:
            if broker.is_running():
                return broker.admin_url
        raise PulsarClusterError("no broker is running")

    @property
    def setup_log_path(self) -> Path:
        return self._directory / "metadata-setup.log"

    def members(self) -> list[ClusterMember]:
        return [*self.bookies, *self.brokers]

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """The ZooKeeper ensemble, the metadata, the bookies, the brokers; each start bounded.
        A failed start leaves no process behind."""
        started = time.monotonic()
        try:
            assert self.zookeeper is not None
            self.zookeeper_start_s = self.zookeeper.start()
            self._set_up_metadata()
            for member in self.members():
                member.start()
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - started

    def _set_up_metadata(self) -> None:
        assert self.zookeeper is not None
        first = self.brokers[0]
        command = [
            *jvm_command(
                self._java,
                self._lib,
                self._directory,
                heap_mb=128,
                direct_memory_mb=64,
                main_class=_SETUP_MAIN_CLASS,
                extra_options=JVM_OPTIONS,
            ),
            *self.setup_args(),
        ]
        (self._directory / "log4j2.properties").write_text(LOG4J2_CONSOLE_CONFIG)
        with open(self.setup_log_path, "ab") as log:
            process = subprocess.Popen(
                command,
                cwd=self._directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            status = process.wait(timeout=SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=SETUP_TIMEOUT_S)
        if status != 0:
            tail = self.setup_log_path.read_bytes()[-4000:].decode(errors="replace")
            what = "timed out" if status is None else f"exited with {status}"
            raise PulsarClusterError(
                f"{_SETUP_MAIN_CLASS} for {first.name} {what}; log tail:\n{tail}"
            )

    def setup_args(self) -> list[str]:
        """PulsarClusterMetadataSetup's arguments (the cluster's name and every broker)."""
        assert self.zookeeper is not None
        store = f"zk:{self.zookeeper.connect_string}"
        return [
            "--cluster",
            CLUSTER_NAME,
            "--metadata-store",
            store,
            "--configuration-metadata-store",
            store,
            "--web-service-url",
            f"http://{','.join(f'{HOST}:{broker.web_port}' for broker in self.brokers)}",
            "--broker-service-url",
            self.service_url,
            "--default-namespace-bundle-number",
            "4",
        ]

    def kill9(self, member: ClusterMember) -> None:
        """SIGKILL to the member's process group (a crash)."""
        self._check_member(member)
        member.kill9()

    def restart(self, member: ClusterMember) -> None:
        """Stop the member (if it runs) and start it again, same ports and data; bounded."""
        self._check_member(member)
        member.stop()
        member.start()

    def _check_member(self, member: ClusterMember) -> None:
        if member not in self.members():
            raise ValueError(f"{member!r} is not a member of this cluster")

    def wait_healthy(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> None:
        """Until every bookie accepts connections and every broker's health check answers
        ``ok``; raises with what is not, after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            unhealthy = self.unhealthy()
            if not unhealthy:
                return
            if time.monotonic() >= deadline:
                raise PulsarClusterError(
                    f"not healthy within {timeout_s:.0f} s: {', '.join(unhealthy)}"
                )
            time.sleep(0.5)

    def unhealthy(self) -> list[str]:
        """The members that are down or not ready (empty: healthy)."""
        return [
            member.name
            for member in self.members()
            if not member.is_running() or not member._ready()
        ]

    def close(self) -> None:
        """Kill every member's process group and every ZooKeeper member, give every port
        back."""
        errors: list[BaseException] = []
        for member in reversed(self.members()):
            try:
                member.close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        if self.zookeeper is not None:
            try:
                self.zookeeper.close()
            except ZooKeeperError as exc:
                errors.append(exc)
        if errors:
            raise PulsarClusterError(f"could not stop everything: {errors}")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- what the tests ask -------------------------------------------------------------------

    def create_namespace(self, namespace: str, timeout_s: float = 30.0) -> None:
        """Create ``TENANT/NAMESPACE`` (Steward's default is ``public/steward``) through the
        admin API of a running broker, as an operator would; one that exists is fine."""
        url = f"{self.admin_url}/admin/v2/namespaces/{namespace}"
        try:
            response = httpx.put(url, json={}, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise PulsarClusterError(f"cannot create namespace {namespace}: {exc}") from None
        if response.status_code not in (204, 409):  # 409: it exists
            raise PulsarClusterError(
                f"cannot create namespace {namespace}: the admin API answered "
                f"{response.status_code}: {response.text[:200]}"
            )

    def owner_of(self, topic: str) -> Broker | None:
        """The broker that owns ``topic`` (``persistent://tenant/ns/name``) by the lookup
        API of a running broker; None when no running broker answers with an owner."""
        path = topic.removeprefix("persistent://")
        for asked in self.brokers:
            if not asked.is_running():
                continue
            try:
                answer = httpx.get(
                    f"{asked.admin_url}/lookup/v2/topic/persistent/{path}", timeout=10.0
                )
            except httpx.HTTPError:
                continue
            if answer.status_code != 200:
                continue
            url = answer.json().get("brokerUrl")
            for broker in self.brokers:
                if broker.service_url == url:
                    return broker
        return None

    def available_bookies(self) -> set[str]:
        """The bookie ids BookKeeper lists as available (``/ledgers/available`` in ZooKeeper:
        a killed bookie stays there until its ZooKeeper session expires, and brokers keep
        placing ledgers on it until then)."""
        assert self.zookeeper is not None
        client = KazooClient(hosts=self.zookeeper.connect_string, timeout=10.0)
        client.start(timeout=10.0)
        try:
            children: list[str] = client.get_children("/ledgers/available")
        finally:
            client.stop()
            client.close()
        return {child for child in children if child != "readonly"}

    def ledger_ensembles(self, topic: str) -> list[list[str]]:
        """The bookie ensembles of the topic's current (last) BookKeeper ledger, oldest
        first, from the admin API's internal stats (``metadata=true``)."""
        path = topic.removeprefix("persistent://")
        answer = httpx.get(
            f"{self.admin_url}/admin/v2/persistent/{path}/internalStats",
            params={"metadata": "true"},
            timeout=10.0,
            follow_redirects=True,  # to the topic's owner
        )
        answer.raise_for_status()
        ledgers: list[dict[str, Any]] = answer.json()["ledgers"]
        if not ledgers:
            return []
        return _ensembles_of(str(ledgers[-1].get("metadata", "")))

    def rss_mb(self) -> dict[str, float]:
        """Every running JVM's resident memory now, MB (``zookeeper-N`` for each ensemble
        member, and each bookie and broker)."""
        sizes: dict[str, float] = {}
        if self.zookeeper is not None:
            for member_id, server in self.zookeeper.members.items():
                if server.is_running() and server.pid is not None:
                    sizes[f"zookeeper-{member_id}"] = _rss_mb(server.pid)
        for member in self.members():
            if member.is_running():
                sizes[member.name] = member.rss_mb()
        return sizes


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise PulsarClusterError(f"no VmRSS in /proc/{pid}/status")


def _ensembles_of(metadata: str) -> list[list[str]]:
    """The ensembles in a ledger's metadata as the admin API prints it (BookKeeper's
    ``LedgerMetadata.toString()``: ``... ensembles={0=[127.0.0.1:A, 127.0.0.1:B], 57=[...]}``)."""
    found = _ENSEMBLES_RE.search(metadata)
    if found is None:
        return []
    return [
        [bookie.strip() for bookie in members.split(",") if bookie.strip()]
        for members in _ENSEMBLE_RE.findall(found.group(1))
    ]


def started_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    brokers: int = 2,
    quorums: Quorums = DEFAULT_QUORUMS,
) -> Iterator[PulsarCluster]:
    """A fixture body: a started cluster, closed (every process group killed, ports given
    back) when the fixture ends, whatever happened."""
    with PulsarCluster(
        tmp_path_factory.mktemp("pulsar-cluster"), brokers=brokers, quorums=quorums
    ) as cluster:
        yield cluster
