"""The members of the real Pulsar cluster of tests/support/pulsar_cluster.py (read its
docstring): a bookie and a broker, each a JVM of the engines cache in a process group of its
own, on 127.0.0.1 on ports reserved for the member's life, with the files written at every
start; and the brokers' quorums.

The partition harness (tests/jepsen/cluster.py) runs the same members in network namespaces
of their own: ``host`` (the address they bind and advertise; a bookie's ``interface``, the
one its address is on), ``port_source`` (its fixed ports) and ``stop_with_parent`` are for
it; the defaults are this harness's."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from clients.dev.engine_jvm import GroupJvmProcess, HeldPort, find_java_or_fail, jvm_command
from clients.dev.local_server import HOST
from clients.dev.pulsar_standalone import (
    LEAN_BROKER_SETTINGS,
    PulsarStandaloneError,
    engines_lib,
)
from clients.dev.zk import DEFAULT_JVM_OPTIONS, LOG4J2_CONSOLE_CONFIG
from tests.support.reserved_ports import reserve_port

CLUSTER_NAME = "steward-test"
#: Bound of a bookie's first start (then the standalone harness's factor of the measured one).
BOOKIE_FIRST_START_TIMEOUT_S = 120.0
#: Bound of a broker's first start.
BROKER_FIRST_START_TIMEOUT_S = 180.0
BOOKIE_HEAP_MB = 128
BOOKIE_DIRECT_MEMORY_MB = 128
BROKER_HEAP_MB = 256
BROKER_DIRECT_MEMORY_MB = 192
#: DbLedgerStorage's caches per bookie, MB.
BOOKIE_CACHE_MB = 16
#: ZooKeeper sessions of brokers and bookies: how long a killed broker keeps owning its
#: topics (its ownership is an ephemeral node) before another broker may take them.
SESSION_TIMEOUT_MS = 6000
#: Beyond the shared flags: the serial collector and the client compiler only, which start a
#: small JVM faster on 2 busy cores (clients/dev/zk.py measured it for ZooKeeper).
JVM_OPTIONS = DEFAULT_JVM_OPTIONS  # the development ZooKeeper's lean JVM (clients/dev/zk.py)
_BOOKIE_MAIN_CLASS = "org.apache.bookkeeper.server.Main"
_BROKER_MAIN_CLASS = "org.apache.pulsar.PulsarBrokerStarter"


class PulsarClusterError(PulsarStandaloneError):
    """The cluster could not be found, set up, started or stopped (details in the message)."""


@dataclass(frozen=True, slots=True)
class Quorums:
    """The brokers' ``managedLedgerDefault*``: how many bookies hold a ledger (ensemble),
    each entry (write quorum) and acknowledge it (ack quorum)."""

    ensemble: int
    write: int
    ack: int

    def __post_init__(self) -> None:
        if not 1 <= self.ack <= self.write <= self.ensemble:
            raise ValueError(f"need 1 <= ack <= write <= ensemble, got {self}")


def _reserve(count: int, port_source: Callable[[], HeldPort]) -> list[HeldPort]:
    reservations: list[HeldPort] = []
    try:
        for _ in range(count):
            reservations.append(port_source())
    except BaseException:
        for reservation in reservations:
            reservation.release()
        raise
    return reservations


def _write_properties(path: Path, lines: list[str]) -> None:
    header = (
        "# Written by tests/support/pulsar_cluster_members.py at every start; edits are lost.\n"
    )
    path.write_text(header + "\n".join(lines) + "\n")


class ClusterMember(GroupJvmProcess):
    """A bookie or a broker: a JVM of the engines cache with reserved ports."""

    error_type = PulsarClusterError

    def __init__(
        self,
        directory: Path,
        *,
        name: str,
        ports: int,
        zookeeper_connect: str,
        heap_mb: int,
        direct_memory_mb: int,
        host: str = HOST,
        port_source: Callable[[], HeldPort] = reserve_port,
        stop_with_parent: bool = True,
    ) -> None:
        self._lib = engines_lib()
        self._java = find_java_or_fail(PulsarClusterError)
        self._host = host
        self._reservations = _reserve(ports, port_source)
        super().__init__(
            directory, port=self._reservations[0].port, stop_with_parent=stop_with_parent
        )
        self._directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.server_name = name
        self.zookeeper_connect = zookeeper_connect
        self.heap_mb = heap_mb
        self.direct_memory_mb = direct_memory_mb

    @property
    def host(self) -> str:
        return self._host

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self._directory / "member.conf"

    @property
    def log_path(self) -> Path:
        return self._directory / "member.log"

    def _config_lines(self) -> list[str]:
        raise NotImplementedError

    def _main_args(self) -> list[str]:
        raise NotImplementedError

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _write_properties(self.config_path, self._config_lines())
        (self._directory / "log4j2.properties").write_text(LOG4J2_CONSOLE_CONFIG)

    def _command(self) -> list[str]:
        return [
            *jvm_command(
                self._java,
                self._lib,
                self._directory,
                heap_mb=self.heap_mb,
                direct_memory_mb=self.direct_memory_mb,
                main_class=self._main_class,
                extra_options=JVM_OPTIONS,
            ),
            *self._main_args(),
        ]

    _main_class = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.address}, pid={self.pid})"


class Bookie(ClusterMember):
    """One BookKeeper bookie (``org.apache.bookkeeper.server.Main``) on 127.0.0.1."""

    first_start_timeout_s = BOOKIE_FIRST_START_TIMEOUT_S
    _main_class = _BOOKIE_MAIN_CLASS

    def __init__(
        self,
        directory: Path,
        *,
        name: str,
        zookeeper_connect: str,
        host: str = HOST,
        interface: str = "lo",
        port_source: Callable[[], HeldPort] = reserve_port,
        stop_with_parent: bool = True,
    ) -> None:
        super().__init__(
            directory,
            name=name,
            ports=1,
            zookeeper_connect=zookeeper_connect,
            heap_mb=BOOKIE_HEAP_MB,
            direct_memory_mb=BOOKIE_DIRECT_MEMORY_MB,
            host=host,
            port_source=port_source,
            stop_with_parent=stop_with_parent,
        )
        self.interface = interface

    @property
    def bookie_id(self) -> str:
        """How BookKeeper names this bookie (in ledger ensembles): ``HOST:PORT``."""
        return f"{self.host}:{self.port}"

    def _config_lines(self) -> list[str]:
        return [
            f"bookiePort={self.port}",
            # On the loopback interface only by default (BookKeeper refuses it without
            # allowLoopback), named by its address (the id ledger ensembles carry).
            f"listeningInterface={self.interface}",
            # Its id's address, said outright: BookKeeper derives it from the interface's
            # host name otherwise, and a name it cannot resolve becomes 127.0.0.1.
            f"advertisedAddress={self.host}",
            "allowLoopback=true",
            "useHostNameAsBookieID=false",
            # BookKeeper's URI separates ZooKeeper servers with ';' (a ',' is Pulsar's).
            "metadataServiceUri=zk+hierarchical://"
            f"{self.zookeeper_connect.replace(',', ';')}/ledgers",
            f"zkTimeout={SESSION_TIMEOUT_MS}",
            f"journalDirectories={self.data_dir / 'journal'}",
            f"ledgerDirectories={self.data_dir / 'ledgers'}",
            # An entry is acknowledged once fsynced to the journal.
            "journalSyncData=true",
            "journalPreAllocSizeMB=4",
            "httpServerEnabled=false",
            "autoRecoveryDaemonEnabled=false",
            "ledgerStorageClass=org.apache.bookkeeper.bookie.storage.ldb.DbLedgerStorage",
            f"dbStorage_writeCacheMaxSizeMb={BOOKIE_CACHE_MB}",
            f"dbStorage_readAheadCacheMaxSizeMb={BOOKIE_CACHE_MB}",
            f"dbStorage_rocksDB_blockCacheSize={BOOKIE_CACHE_MB * 1024 * 1024}",
            "dbStorage_rocksDB_writeBufferSizeMB=4",
            # A shared test machine's disk may be fuller than the 95% default allows.
            "diskUsageThreshold=0.99",
            "diskUsageWarnThreshold=0.98",
        ]

    def _main_args(self) -> list[str]:
        return ["--conf", str(self.config_path)]

    def _ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0):
                return True
        except OSError:
            return False


class Broker(ClusterMember):
    """One Pulsar broker (``org.apache.pulsar.PulsarBrokerStarter``) on 127.0.0.1."""

    first_start_timeout_s = BROKER_FIRST_START_TIMEOUT_S
    _main_class = _BROKER_MAIN_CLASS

    def __init__(
        self,
        directory: Path,
        *,
        name: str,
        zookeeper_connect: str,
        quorums: Quorums,
        host: str = HOST,
        port_source: Callable[[], HeldPort] = reserve_port,
        stop_with_parent: bool = True,
        extra_settings: Sequence[str] = (),
    ) -> None:
        super().__init__(
            directory,
            name=name,
            ports=2,
            zookeeper_connect=zookeeper_connect,
            heap_mb=BROKER_HEAP_MB,
            direct_memory_mb=BROKER_DIRECT_MEMORY_MB,
            host=host,
            port_source=port_source,
            stop_with_parent=stop_with_parent,
        )
        self.web_port = self._reservations[1].port
        self.quorums = quorums
        #: ``key=value`` lines after the others (a later key wins).
        self.extra_settings = tuple(extra_settings)

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.web_port}"

    def _config_lines(self) -> list[str]:
        return [
            f"clusterName={CLUSTER_NAME}",
            f"metadataStoreUrl=zk:{self.zookeeper_connect}",
            f"configurationMetadataStoreUrl=zk:{self.zookeeper_connect}",
            f"metadataStoreSessionTimeoutMillis={SESSION_TIMEOUT_MS}",
            f"bindAddress={self.host}",
            f"advertisedAddress={self.host}",
            f"brokerServicePort={self.port}",
            f"webServicePort={self.web_port}",
            f"managedLedgerDefaultEnsembleSize={self.quorums.ensemble}",
            f"managedLedgerDefaultWriteQuorum={self.quorums.write}",
            f"managedLedgerDefaultAckQuorum={self.quorums.ack}",
            # A topic moves between brokers only when a test makes it.
            "loadBalancerSheddingEnabled=false",
            *LEAN_BROKER_SETTINGS,
            "numIOThreads=2",
            "numHttpServerThreads=4",
            *self.extra_settings,
        ]

    def _main_args(self) -> list[str]:
        return ["--broker-conf", str(self.config_path)]

    def health(self) -> str | None:
        """The admin health check's answer (``ok`` when healthy); None when it does not answer."""
        try:
            answer = httpx.get(f"{self.admin_url}/admin/v2/brokers/health", timeout=10.0)
        except httpx.HTTPError:
            return None
        return answer.text.strip() if answer.status_code == 200 else None

    def _ready(self) -> bool:
        return self.health() == "ok"
