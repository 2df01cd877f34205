"""A real Apache Pulsar standalone for tests and ``steward cluster up`` (issue 31): one JVM
with a broker and one bookie, from the jars of the engines cache (tests/engines/pom.xml,
filled by scripts/setup's ``steward_setup_engines``; docs/TESTING.md, "The engines cache"):
``$STEWARD_ENGINES_DIR``, else the checkout's ``.cache/engines``. Without the jars,
:func:`engines_lib` raises saying what to run.

``org.apache.pulsar.PulsarStandaloneStarter`` runs with ``java -cp '<cache>/lib/*'`` and a
``standalone.conf`` written here (it is read as the broker's and the bookie's
configuration), with ``-nfw`` (no functions worker) and ``-nss`` (no stream storage):

- Everything on 127.0.0.1: ``bindAddress`` and ``advertisedAddress``; the bookie listens on
  the loopback interface (``listeningInterface=lo``, ``allowLoopback``). The broker, web and
  bookie ports come from the ``port_source`` given: free ones by default; the tests reserve
  them for the server's life (tests/support/reserved_ports.py); ``steward cluster up`` takes
  the ones recorded in the directory's :data:`PORTS_FILE` by the last start
  (:func:`kept_ports`), since the bookie's data names its port.
- Metadata: the standalone's default since Pulsar 2.11, a RocksDB metadata store in the
  data directory, in the same JVM. Not ZooKeeper: ``PULSAR_STANDALONE_USE_ZOOKEEPER=1``
  starts an in-process ZooKeeper that binds every interface (its port has no address
  setting), and the real cluster harness (issue 31, 1b) gets the suite's own ZooKeeper.
  The variable is removed from the server's environment so the choice holds.
- One bookie: the managed ledger's ensemble, write and ack quorums are 1; the bookie
  journals with ``journalSyncData=true`` and DbLedgerStorage's caches are sized down.
- A small JVM: :data:`HEAP_MB` heap, :data:`DIRECT_MEMORY_MB` direct memory, and by default
  the development ZooKeeper's lean options (one JIT tier, the serial collector: a quiet
  start 7 s and 380 MB rather than 8-9 s and 420-510 MB; ``jvm_options=()`` for the JVM's
  defaults, as the benchmarks run it).

Token authentication and TLS, both off by default (``token_auth=``, ``tls=``: any objects
with the shapes of :class:`TokenAuth` and :class:`TlsCertificates`; the tests' are in
tests/support/pulsar_security.py and tests/support/tls_certs.py). With TLS, two more ports
(:attr:`PulsarStandalone.tls_service_url`, :attr:`PulsarStandalone.tls_admin_url`); the plain
ports stay, and the readiness check below uses them, with a super-user token under
``token_auth``.

Ready means the admin health check (``/admin/v2/brokers/health``: a write and read on a
heartbeat topic) answers ``ok`` and the ``public/default`` namespace, which the standalone
creates after its broker starts, exists. The first start is bounded by
``FIRST_START_TIMEOUT_S`` and measured (:attr:`PulsarStandalone.first_start_s`); later
starts by ``LATER_START_FACTOR`` times that (clients/dev/engine_jvm.py).

The JVM runs in a process group of its own (clients/dev/engine_jvm.py's
:class:`~clients.dev.engine_jvm.GroupJvmProcess`, which the tests' cluster harness shares);
``stop``, ``kill9`` and ``close`` signal the whole group, and
the kernel sends it SIGTERM if the thread that started it ends (``stop_with_parent``). Its
output is kept in ``pulsar.log`` in the server's directory; a failed start raises with its
tail.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import httpx

from clients.dev.engine_jvm import (
    EngineError,
    FreePort,
    GroupJvmProcess,
    HeldPort,
    any_free_port,
    find_java_or_fail,
    jvm_command,
)
from clients.dev.local_server import HOST
from clients.dev.zk import DEFAULT_JVM_OPTIONS, LOG4J2_CONSOLE_CONFIG

ROOT = Path(__file__).resolve().parents[2]
ENGINES_POM = ROOT / "tests" / "engines" / "pom.xml"
#: Environment variable naming the engines cache (default: the checkout's ``.cache/engines``).
ENGINES_DIR_ENV = "STEWARD_ENGINES_DIR"
#: The ports a standalone used, written at each start (read back by :func:`kept_ports`).
PORTS_FILE = "ports.json"
HEAP_MB = 512
DIRECT_MEMORY_MB = 256
#: The bookie's DbLedgerStorage caches (MB; Pulsar's defaults are a quarter of direct memory).
BOOKIE_CACHE_MB = 16
CLUSTER_NAME = "standalone"
_MAIN_CLASS = "org.apache.pulsar.PulsarStandaloneStarter"
_VERSION_RE = re.compile(r"<pulsar\.version>([^<]+)</pulsar\.version>")


#: A Pulsar broker's settings beside its addresses and quorums, for the standalone and the
#: tests' cluster brokers (tests/support/pulsar_cluster_members.py).
LEAN_BROKER_SETTINGS = (
    # Nothing Steward does not use, a quick shutdown.
    "functionsWorkerEnabled=false",
    "transactionCoordinatorEnabled=false",
    # Steward sets namespace policies only. Topic-level policies live in a system topic whose
    # reader a crash can leave unrecoverable ("Failed to recover Transaction Buffer"): every
    # topic of the namespace then fails to load after the restart.
    "topicLevelPoliciesEnabled=false",
    "systemTopicEnabled=false",
    "brokerShutdownTimeoutMs=5000",
    "managedLedgerCacheSizeMB=32",
    # No NIC speed in a container's /sys: the load manager would log errors.
    "loadBalancerOverrideBrokerNicSpeedGbps=1",
)


class PulsarStandaloneError(EngineError):
    """The Pulsar standalone could not be found, started or stopped (details in the message)."""


class TokenAuth(Protocol):
    """Token authentication's settings: its ``standalone.conf`` lines (the standalone's own
    client included) and a super-user token (``role=None``) for the readiness check."""

    def config_lines(self) -> list[str]: ...

    def token(self, role: str | None = None) -> str: ...


class TlsCertificates(Protocol):
    """The broker's certificate, its key (PKCS#8, which Java reads) and the CA (PEM files)."""

    @property
    def cert_path(self) -> Path: ...

    @property
    def key_path(self) -> Path: ...

    @property
    def ca_path(self) -> Path: ...


def tls_config_lines(tls: TlsCertificates, broker_tls_port: int, web_tls_port: int) -> list[str]:
    """The broker and web service on TLS ports too, with ``tls``'s certificate."""
    return [
        f"brokerServicePortTls={broker_tls_port}",
        f"webServicePortTls={web_tls_port}",
        f"tlsCertificateFilePath={tls.cert_path}",
        f"tlsKeyFilePath={tls.key_path}",
        f"tlsTrustCertsFilePath={tls.ca_path}",
        # Clients need no certificate of their own (token authentication says who they are).
        "tlsRequireTrustedClientCertOnConnect=false",
        "tlsAllowInsecureConnection=false",
    ]


def pulsar_version() -> str:
    """The Pulsar version tests/engines/pom.xml pins (its one definition)."""
    try:
        pom = ENGINES_POM.read_text()
    except OSError:
        raise PulsarStandaloneError(
            f"no {ENGINES_POM}: Apache Pulsar's version is pinned there, in a steward checkout; "
            "run steward from one"
        ) from None
    match = _VERSION_RE.search(pom)
    if match is None:
        raise PulsarStandaloneError(f"{ENGINES_POM} names no <pulsar.version>")
    return match.group(1)


def engines_dir() -> Path:
    """The engines cache: ``$STEWARD_ENGINES_DIR``, else the checkout's ``.cache/engines``
    (where ./scripts/fetch-engines puts the jars)."""
    override = os.environ.get(ENGINES_DIR_ENV)
    return Path(override) if override else ROOT / ".cache" / "engines"


def engines_lib() -> Path:
    """The cached jars (``<engines cache>/pulsar-VERSION/lib``); raises, saying how to fetch
    them, when they are not there."""
    version = pulsar_version()
    lib = engines_dir() / f"pulsar-{version}" / "lib"
    if not (lib / f"pulsar-broker-{version}.jar").is_file():
        raise PulsarStandaloneError(
            f"no Apache Pulsar {version} jars in {lib}: run ./scripts/fetch-engines in the "
            f"steward checkout {ROOT} (./scripts/test does it before the suite), or point "
            f"{ENGINES_DIR_ENV} at a cache holding pulsar-{version}/lib"
        )
    return lib


def kept_ports(directory: str | os.PathLike[str]) -> Callable[[], HeldPort]:
    """A port source for a standalone whose data outlives it (``steward cluster up``): the
    ports the last standalone in ``directory`` used, in order, else free ones. The bookie's
    cookie and every ledger's ensemble name the bookie by address and port, so a restart on
    another port would lose the data."""
    try:
        recorded = [int(port) for port in json.loads((Path(directory) / PORTS_FILE).read_text())]
    except (OSError, ValueError, TypeError):
        recorded = []
    remaining = iter(recorded)

    def next_port() -> HeldPort:
        port = next(remaining, None)
        return FreePort(port) if port is not None else any_free_port()

    return next_port


class PulsarStandalone(GroupJvmProcess):
    """One Pulsar standalone (broker + bookie, RocksDB metadata) on 127.0.0.1 in ``directory``.

    Ports are chosen at construction (``port_source``) and kept across restarts;
    :meth:`close` stops the server and gives them back. Use it as a context manager or call
    :meth:`close`.
    """

    server_name = "Apache Pulsar standalone"
    error_type = PulsarStandaloneError

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        port_source: Callable[[], HeldPort] = any_free_port,
        stop_with_parent: bool = True,
        token_auth: TokenAuth | None = None,
        tls: TlsCertificates | None = None,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
    ) -> None:
        # The lean JVM of the development ZooKeeper (no C2 compiler, the serial collector):
        # starts sooner and uses less CPU and memory on a small machine; the benchmarks pass
        # () for the JVM's defaults, as a deployed Pulsar runs.
        self.jvm_options = tuple(jvm_options)
        self.token_auth = token_auth
        self.tls = tls
        self._lib = engines_lib()
        self._java = find_java_or_fail(PulsarStandaloneError)
        self._reservations: list[HeldPort] = []
        try:
            for _ in range(5 if tls is not None else 3):
                self._reservations.append(port_source())
        except BaseException:
            self._release_ports()
            raise
        broker, web, bookie = (r.port for r in self._reservations[:3])
        super().__init__(directory, port=broker, stop_with_parent=stop_with_parent)
        self.web_port = web
        self.bookie_port = bookie
        #: The TLS ports (binary protocol, web service); None without ``tls``.
        self.tls_port: int | None = self._reservations[3].port if tls else None
        self.tls_web_port: int | None = self._reservations[4].port if tls else None
        self.version = pulsar_version()

    # -- addresses ------------------------------------------------------------------------------

    @property
    def service_url(self) -> str:
        return f"pulsar://{HOST}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.web_port}"

    @property
    def tls_service_url(self) -> str:
        assert self.tls_port is not None, "started without tls="
        return f"pulsar+ssl://{HOST}:{self.tls_port}"

    @property
    def tls_admin_url(self) -> str:
        assert self.tls_web_port is not None, "started without tls="
        return f"https://{HOST}:{self.tls_web_port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The admin API's headers: a super-user token with ``token_auth``, else none."""
        if self.token_auth is None:
            return {}
        return {"Authorization": f"Bearer {self.token_auth.token()}"}

    @property
    def config_path(self) -> Path:
        return self._directory / "standalone.conf"

    @property
    def log_path(self) -> Path:
        return self._directory / "pulsar.log"

    # -- lifecycle ------------------------------------------------------------------------------

    def _ready(self) -> bool:
        try:
            headers = self.admin_headers
            health = httpx.get(
                f"{self.admin_url}/admin/v2/brokers/health", headers=headers, timeout=5.0
            )
            if health.status_code != 200 or health.text.strip() != "ok":
                return False
            namespaces = httpx.get(
                f"{self.admin_url}/admin/v2/namespaces/public", headers=headers, timeout=5.0
            )
        except httpx.HTTPError:
            return False
        return namespaces.status_code == 200 and "public/default" in namespaces.json()

    def create_namespace(self, namespace: str, timeout_s: float = 30.0) -> None:
        """Create ``TENANT/NAMESPACE`` (Steward's default is ``public/steward``) through the
        admin API; one that exists already is fine. The brokers apply its retention policy
        themselves (docs/OPERATIONS.md, "Ledgers: Pulsar on BookKeeper")."""
        url = f"{self.admin_url}/admin/v2/namespaces/{namespace}"
        try:
            response = httpx.put(url, json={}, headers=self.admin_headers, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise PulsarStandaloneError(f"cannot create namespace {namespace}: {exc}") from None
        if response.status_code not in (204, 409):  # 409: it exists
            raise PulsarStandaloneError(
                f"cannot create namespace {namespace}: the admin API answered "
                f"{response.status_code}: {response.text[:200]}"
            )

    # -- files and command ----------------------------------------------------------------------

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "# Written by clients/dev/pulsar_standalone.py at every start; edits are lost.",
            f"clusterName={CLUSTER_NAME}",
            f"bindAddress={HOST}",
            f"advertisedAddress={HOST}",
            f"brokerServicePort={self.port}",
            f"webServicePort={self.web_port}",
            # One bookie.
            "managedLedgerDefaultEnsembleSize=1",
            "managedLedgerDefaultWriteQuorum=1",
            "managedLedgerDefaultAckQuorum=1",
            # The bookie (this file is its configuration too): on the loopback interface
            # only (else it binds 0.0.0.0), on the port given (--bookkeeper-port; without
            # allowEphemeralPorts the standalone picks a free one of its own).
            "allowLoopback=true",
            "listeningInterface=lo",
            "allowEphemeralPorts=true",
            "journalSyncData=true",
            "httpServerEnabled=false",
            "ledgerStorageClass=org.apache.bookkeeper.bookie.storage.ldb.DbLedgerStorage",
            f"dbStorage_writeCacheMaxSizeMb={BOOKIE_CACHE_MB}",
            f"dbStorage_readAheadCacheMaxSizeMb={BOOKIE_CACHE_MB}",
            f"dbStorage_rocksDB_blockCacheSize={BOOKIE_CACHE_MB * 1024 * 1024}",
            *LEAN_BROKER_SETTINGS,
        ]
        if self.token_auth is not None:
            lines += self.token_auth.config_lines()
        if self.tls is not None:
            assert self.tls_port is not None and self.tls_web_port is not None
            lines += tls_config_lines(self.tls, self.tls_port, self.tls_web_port)
        self.config_path.write_text("\n".join(lines) + "\n")
        ports = [self.port, self.web_port, self.bookie_port]
        (self._directory / PORTS_FILE).write_text(json.dumps(ports) + "\n")
        (self._directory / "log4j2.properties").write_text(LOG4J2_CONSOLE_CONFIG)

    def _command(self) -> list[str]:
        return [
            # The metadata choice must not depend on the caller's environment (env execs
            # java: the same pid, the same process group).
            "env",
            "-u",
            "PULSAR_STANDALONE_USE_ZOOKEEPER",
            *jvm_command(
                self._java,
                self._lib,
                self._directory,
                heap_mb=HEAP_MB,
                direct_memory_mb=DIRECT_MEMORY_MB,
                main_class=_MAIN_CLASS,
                extra_options=self.jvm_options,
            ),
            "--config",
            str(self.config_path),
            "--bookkeeper-port",
            str(self.bookie_port),
            "--bookkeeper-dir",
            str(self.data_dir / "bookkeeper"),
            "--metadata-dir",
            str(self.data_dir / "metadata"),
            "-nfw",
            "-nss",
        ]

    def __repr__(self) -> str:
        return f"PulsarStandalone({self.service_url}, pid={self.pid}, dir={self._directory})"
