"""A real Apache Pulsar standalone for tests (issue 31): one JVM with a broker and one bookie,
from the jars of the engines cache (tests/engines/pom.xml, filled by scripts/setup's
``steward_setup_engines``; docs/TESTING.md, "The engines cache").

``org.apache.pulsar.PulsarStandaloneStarter`` runs with ``java -cp '<cache>/lib/*'`` and a
``standalone.conf`` written here (it is read as the broker's and the bookie's
configuration), with ``-nfw`` (no functions worker) and ``-nss`` (no stream storage):

- Everything on 127.0.0.1: ``bindAddress`` and ``advertisedAddress``; the bookie listens on
  the loopback interface (``listeningInterface=lo``, ``allowLoopback``). The broker, web and
  bookie ports are reserved (tests/support/reserved_ports.py) for the server's life.
- Metadata: the standalone's default since Pulsar 2.11, a RocksDB metadata store in the
  data directory, in the same JVM. Not ZooKeeper: ``PULSAR_STANDALONE_USE_ZOOKEEPER=1``
  starts an in-process ZooKeeper that binds every interface (its port has no address
  setting), and the real cluster harness (tests/support/pulsar_cluster.py) runs a
  ZooKeeper server of its own.
  The variable is removed from the server's environment so the choice holds.
- One bookie: the managed ledger's ensemble, write and ack quorums are 1; the bookie
  journals with ``journalSyncData=true`` and DbLedgerStorage's caches are sized down.
- A small JVM: :data:`HEAP_MB` heap, :data:`DIRECT_MEMORY_MB` direct memory.

Ready means the admin health check (``/admin/v2/brokers/health``: a write and read on a
heartbeat topic) answers ``ok`` and the ``public/default`` namespace, which the standalone
creates after its broker starts, exists. The first start is bounded by
:data:`FIRST_START_TIMEOUT_S` and measured (:attr:`PulsarStandalone.first_start_s`); later
starts by :data:`LATER_START_FACTOR` times that (at least :data:`LATER_START_MIN_TIMEOUT_S`).

The JVM runs in a process group of its own (:class:`GroupJvmProcess`, which the cluster
harness's members share with :func:`jvm_command` and :func:`engines_lib`);
:meth:`~GroupJvmProcess.stop`, :meth:`~GroupJvmProcess.kill9` and
:meth:`~GroupJvmProcess.close` signal the whole group, and
the kernel sends it SIGTERM if the thread that started it ends (``stop_with_parent``). Its
output is kept in ``pulsar.log`` in the server's directory; a failed start raises with its
tail.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Self

import httpx
import pytest

from clients.dev.local_server import HOST, LocalServerProcess
from clients.dev.zk import LOG4J2_CONSOLE_CONFIG, ZooKeeperError, find_java
from tests.support.reserved_ports import PortReservation, reserve_port

ROOT = Path(__file__).resolve().parents[2]
ENGINES_POM = ROOT / "tests" / "engines" / "pom.xml"
#: Bound of the first start, before one is measured.
FIRST_START_TIMEOUT_S = 180.0
#: Later starts: this many times the first start's measured time...
LATER_START_FACTOR = 4.0
#: ...and never less than this.
LATER_START_MIN_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
HEAP_MB = 512
DIRECT_MEMORY_MB = 256
#: The bookie's DbLedgerStorage caches (MB; Pulsar's defaults are a quarter of direct memory).
BOOKIE_CACHE_MB = 16
CLUSTER_NAME = "standalone"
_MAIN_CLASS = "org.apache.pulsar.PulsarStandaloneStarter"
# What Pulsar's own bin/pulsar gives Java 17: Netty and the broker's metrics reach into
# these JDK internals.
_JVM_OPENS = (
    "java.base/java.lang",
    "java.base/java.io",
    "java.base/java.nio",
    "java.base/java.util",
    "java.base/sun.net",
    "java.base/jdk.internal.misc",
    "java.management/sun.management",
    "jdk.management/com.sun.management.internal",
)
_VERSION_RE = re.compile(r"<pulsar\.version>([^<]+)</pulsar\.version>")


class PulsarStandaloneError(RuntimeError):
    """The Pulsar standalone could not be found, started or stopped (details in the message)."""


def pulsar_version() -> str:
    """The Pulsar version tests/engines/pom.xml pins (its one definition)."""
    match = _VERSION_RE.search(ENGINES_POM.read_text())
    if match is None:
        raise PulsarStandaloneError(f"{ENGINES_POM} names no <pulsar.version>")
    return match.group(1)


def engines_lib() -> Path:
    """The cached jars (``.cache/engines/pulsar-VERSION/lib``); raises, saying how to fetch
    them, when they are not there."""
    version = pulsar_version()
    lib = ROOT / ".cache" / "engines" / f"pulsar-{version}" / "lib"
    if not (lib / f"pulsar-broker-{version}.jar").is_file():
        raise PulsarStandaloneError(
            f"no Apache Pulsar {version} jars in {lib}: run ./scripts/fetch-engines "
            "(./scripts/test does it before the suite)"
        )
    return lib


def jvm_command(
    java: str,
    lib: Path,
    directory: Path,
    *,
    heap_mb: int,
    direct_memory_mb: int,
    main_class: str,
    extra_options: Sequence[str] = (),
) -> list[str]:
    """``java ... -cp '<lib>/*' MAIN_CLASS`` for a Pulsar or BookKeeper JVM of the engines
    cache: a fixed heap, bounded direct memory, the JDK internals Pulsar's own ``bin/pulsar``
    opens, log4j2 from ``directory/log4j2.properties`` (written by the caller). The one
    definition for the standalone and the cluster harness (tests/support/pulsar_cluster.py)."""
    return [
        java,
        f"-Xms{heap_mb}m",
        f"-Xmx{heap_mb}m",
        f"-XX:MaxDirectMemorySize={direct_memory_mb}m",
        *extra_options,
        *(f"--add-opens={module}=ALL-UNNAMED" for module in _JVM_OPENS),
        "-Dio.netty.tryReflectionSetAccessible=true",
        f"-Dlog4j2.configurationFile={directory / 'log4j2.properties'}",
        f"-Dpulsar.log.dir={directory}",
        "-cp",
        str(lib / "*"),
        main_class,
    ]


def find_java_or_fail(error_type: type[Exception]) -> str:
    """``java`` (clients/dev/zk.py's search), or ``error_type`` saying how to get it."""
    try:
        return find_java()
    except ZooKeeperError as exc:
        raise error_type(str(exc)) from None


class GroupJvmProcess(LocalServerProcess):
    """A JVM of the engines cache in a process group of its own: :meth:`stop`, :meth:`kill9`
    and :meth:`close` signal the whole group. Subclasses hold the ports they reserved in
    ``_reservations`` (given back by :meth:`close`)."""

    error_type: type[Exception] = PulsarStandaloneError
    #: Bound of the first start, before one is measured.
    first_start_timeout_s = FIRST_START_TIMEOUT_S
    _reservations: list[PortReservation]

    def __init__(
        self, directory: str | os.PathLike[str], *, port: int, stop_with_parent: bool
    ) -> None:
        super().__init__(directory, port=port, stop_with_parent=stop_with_parent)
        #: The first start's measured time (launch to ready), seconds.
        self.first_start_s: float | None = None
        #: Every start's measured time, seconds.
        self.start_times_s: list[float] = []

    @property
    def start_timeout_s(self) -> float:  # type: ignore[override]  # a class attribute there
        """:attr:`first_start_timeout_s` until a start is measured, then
        :data:`LATER_START_FACTOR` times the first (at least :data:`LATER_START_MIN_TIMEOUT_S`)."""
        if self.first_start_s is None:
            return self.first_start_timeout_s
        return max(LATER_START_MIN_TIMEOUT_S, LATER_START_FACTOR * self.first_start_s)

    def start(self, timeout_s: float | None = None) -> None:
        """Launch and wait until ready (bounded by :attr:`start_timeout_s` unless given);
        the time is measured. A failed start leaves no process behind."""
        started = time.monotonic()
        try:
            super().start(timeout_s)
        except BaseException:
            self._kill_group()
            raise
        took_s = time.monotonic() - started
        self.start_times_s.append(took_s)
        if self.first_start_s is None:
            self.first_start_s = took_s

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the process group, wait up to ``timeout_s``, then SIGKILL to the group."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal_group(signal.SIGTERM)
            if self._paused:
                self._signal_group(signal.SIGCONT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout_s)
        self._kill_group()

    def kill9(self) -> None:
        """SIGKILL to the process group (a crash). No-op when not running."""
        self._kill_group()

    def _kill_process(self) -> None:
        # The base class's start() calls this when the server is not ready in time.
        self._kill_group()

    def _kill_group(self) -> None:
        process = self._process
        if process is None:
            return
        self._signal_group(signal.SIGKILL)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise self.error_type(
                f"{self.server_name} pid {process.pid} survived SIGKILL"
            ) from None
        self._process = None
        self._paused = False

    def _signal_group(self, signum: signal.Signals) -> None:
        process = self._process
        if process is None:
            return
        # start_new_session: the JVM leads its own group, whose id is its pid.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)

    def close(self) -> None:
        """Stop (the whole process group) and give the ports back."""
        try:
            self.stop()
        finally:
            self._release_ports()

    def _release_ports(self) -> None:
        for reservation in self._reservations:
            reservation.release()

    def __enter__(self) -> Self:
        try:
            if not self.is_running():
                self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def rss_mb(self) -> float:
        """The JVM's resident memory now (VmRSS), MB."""
        if self.pid is None:
            raise self.error_type(f"{self.server_name} is not running")
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        if match is None:
            raise self.error_type(f"no VmRSS in /proc/{self.pid}/status")
        return int(match.group(1)) / 1024


class PulsarStandalone(GroupJvmProcess):
    """One Pulsar standalone (broker + bookie, RocksDB metadata) on 127.0.0.1 in ``directory``.

    Ports are reserved at construction and kept across restarts; :meth:`close` stops the
    server and gives them back. Use it as a context manager or call :meth:`close`.
    """

    server_name = "Apache Pulsar standalone"
    error_type = PulsarStandaloneError
    start_log_bytes = 4 * 1024 * 1024
    ready_poll_s = 0.5
    port_taken_markers = ("Address already in use", "BindException")

    def __init__(self, directory: str | os.PathLike[str], *, stop_with_parent: bool = True) -> None:
        self._lib = engines_lib()
        self._java = find_java_or_fail(PulsarStandaloneError)
        self._reservations: list[PortReservation] = []
        try:
            for _ in range(3):
                self._reservations.append(reserve_port())
        except BaseException:
            self._release_ports()
            raise
        broker, web, bookie = (r.port for r in self._reservations)
        super().__init__(directory, port=broker, stop_with_parent=stop_with_parent)
        self.web_port = web
        self.bookie_port = bookie
        self.version = pulsar_version()

    # -- addresses ------------------------------------------------------------------------------

    @property
    def service_url(self) -> str:
        return f"pulsar://{HOST}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.web_port}"

    @property
    def config_path(self) -> Path:
        return self._directory / "standalone.conf"

    @property
    def log_path(self) -> Path:
        return self._directory / "pulsar.log"

    # -- lifecycle ------------------------------------------------------------------------------

    def _ready(self) -> bool:
        try:
            health = httpx.get(f"{self.admin_url}/admin/v2/brokers/health", timeout=5.0)
            if health.status_code != 200 or health.text.strip() != "ok":
                return False
            namespaces = httpx.get(f"{self.admin_url}/admin/v2/namespaces/public", timeout=5.0)
        except httpx.HTTPError:
            return False
        return namespaces.status_code == 200 and "public/default" in namespaces.json()

    # -- files and command ----------------------------------------------------------------------

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "# Written by tests/support/pulsar_standalone.py at every start; edits are lost.",
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
            # The broker: nothing the tests do not use, a quick shutdown.
            "functionsWorkerEnabled=false",
            "transactionCoordinatorEnabled=false",
            "brokerShutdownTimeoutMs=5000",
            "managedLedgerCacheSizeMB=32",
            # No NIC speed in a container's /sys: the load manager would log errors.
            "loadBalancerOverrideBrokerNicSpeedGbps=1",
        ]
        self.config_path.write_text("\n".join(lines) + "\n")
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


def started_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarStandalone]:
    """A fixture body: a started standalone, closed (process group killed, ports given back)
    when the fixture ends, whatever happened."""
    with PulsarStandalone(tmp_path_factory.mktemp("pulsar-standalone")) as server:
        yield server
