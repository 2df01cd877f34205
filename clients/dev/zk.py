"""A real standalone ZooKeeper server as a subprocess, for tests and the local dev cluster.

The server is started the way found to work on these machines: a config file with
``tickTime=500`` (session timeouts between 1 and 10 s, so tests can use short ones), bound to
127.0.0.1 only, four-letter words ``srvr``/``ruok``/``mntr`` allowed, the admin HTTP server off,
and ``ZooKeeperServerMain`` run from the jars that ``pyspark`` ships (Debian's ``zookeeper``
package is the fallback). The server is ready when ``srvr`` answers with a ``Mode:`` line
(``ruok`` answers before the server accepts sessions).

Every wait is bounded and signals go to the server's pid only.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from clients.dev.local_server import HOST, LocalServerProcess

logger = logging.getLogger(__name__)

DEFAULT_TICK_TIME_MS = 500
DEFAULT_START_TIMEOUT_S = 30.0
DEFAULT_STOP_TIMEOUT_S = 10.0
DEFAULT_HEAP_MB = 256
#: Beyond the plain command: a small server's JVM starts about twice as fast with one
#: JIT compiler tier and the serial collector (measured here on 2 busy CPUs: 6-8 s -> 3-4 s),
#: which matters for tests that start and restart servers. Pass ``jvm_options=()`` to drop.
DEFAULT_JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
#: Environment variable that overrides the classpath search (a ``java -cp`` value).
CLASSPATH_ENV = "STEWARD_ZOOKEEPER_CLASSPATH"
_MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
_DEBIAN_JAR_DIR = "/usr/share/java"
# What Debian's zookeeper package needs besides zookeeper.jar (names vary between releases,
# hence patterns; missing ones are simply left out).
_DEBIAN_DEPENDENCY_PATTERNS = (
    "zookeeper-jute*.jar",
    "slf4j-api*.jar",
    "slf4j-simple*.jar",
    "logback-*.jar",
    "log4j-1.2*.jar",
    "netty-*.jar",
    "netty.jar",
    "jline*.jar",
    "commons-cli*.jar",
    "commons-io*.jar",
    "metrics-core*.jar",
    "snappy-java*.jar",
)
#: Log4j 2 to the console (stdout, kept as the server's log); the Pulsar harness uses it too.
LOG4J2_CONSOLE_CONFIG = """\
status = warn
appender.console.type = Console
appender.console.name = console
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{ISO8601} %-5p [%t] %c{1}: %m%n
rootLogger.level = info
rootLogger.appenderRef.console.ref = console
"""
_LOG_TAIL_BYTES = 4000
# One start logs the whole classpath (pyspark's jars: ~100 KB); read all of it to find why.
_MAX_START_LOG_BYTES = 4 * 1024 * 1024


class ZooKeeperError(RuntimeError):
    """The ZooKeeper server could not be found, started or stopped (details in the message)."""


def find_zookeeper_classpath() -> str:
    """The ``java -cp`` value that holds ZooKeeper and its dependencies.

    Order: ``$STEWARD_ZOOKEEPER_CLASSPATH``, then ``<pyspark>/jars/*`` (pyspark 4 ships
    ZooKeeper 3.9), then Debian's ``/usr/share/java/zookeeper.jar`` with the dependency jars
    found beside it. Raises :class:`ZooKeeperError` naming what was searched.
    """
    override = os.environ.get(CLASSPATH_ENV)
    if override:
        return override
    searched: list[str] = []
    # find_spec instead of import: importing pyspark costs time and is not needed here.
    spec = importlib.util.find_spec("pyspark")
    if spec is not None and spec.origin is not None:
        jar_dir = os.path.join(os.path.dirname(spec.origin), "jars")
        searched.append(os.path.join(jar_dir, "zookeeper-*.jar"))
        if glob.glob(os.path.join(jar_dir, "zookeeper-[0-9]*.jar")):
            return os.path.join(jar_dir, "*")
    else:
        searched.append("pyspark (not installed)")
    debian_jar = os.path.join(_DEBIAN_JAR_DIR, "zookeeper.jar")
    searched.append(debian_jar)
    if os.path.isfile(debian_jar):
        jars = [debian_jar]
        for pattern in _DEBIAN_DEPENDENCY_PATTERNS:
            jars.extend(sorted(glob.glob(os.path.join(_DEBIAN_JAR_DIR, pattern))))
        return os.pathsep.join(dict.fromkeys(jars))
    raise ZooKeeperError(
        "no ZooKeeper jars found (searched: "
        + ", ".join(searched)
        + f"); install pyspark>=4 or Debian's zookeeper package, or set {CLASSPATH_ENV}"
    )


def find_java() -> str:
    """The ``java`` executable (``$JAVA_HOME/bin/java`` first, then ``PATH``)."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = os.path.join(java_home, "bin", "java")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("java")
    if found is None:
        raise ZooKeeperError("java not found (set JAVA_HOME or put java on PATH; Java 17 works)")
    return found


def four_letter_word(host: str, port: int, word: str, timeout_s: float = 2.0) -> str:
    """Send a ZooKeeper four-letter command (``srvr``, ``ruok``, ``mntr``) and return the answer.

    Raises :class:`OSError` (including ``TimeoutError``) when the server does not answer.
    """
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(word.encode("ascii"))
        chunks: list[bytes] = []
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(f"{word} to {host}:{port} got no complete answer")
            sock.settimeout(remaining_s)
            chunk = sock.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


class ZooKeeperServer(LocalServerProcess):
    """One standalone ZooKeeper server process on 127.0.0.1.

    Everything lives in ``directory``: ``zoo.cfg``, ``data/`` (snapshots and transaction log,
    kept across :meth:`restart`) and ``zookeeper.log`` (the server's output, appended to by
    every start). The port is chosen once (a free one unless given) and kept across restarts,
    so clients can reconnect to the same address.

    ``stop_with_parent=True`` (Linux, for tests) makes the kernel send the server SIGTERM
    when the thread that started it ends, so a killed test run leaves no JVM behind.
    """

    server_name = "ZooKeeper"
    error_type = ZooKeeperError
    # One start logs the whole classpath: read all of it to find why it failed.
    start_log_bytes = _MAX_START_LOG_BYTES

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        port: int | None = None,
        tick_time_ms: int = DEFAULT_TICK_TIME_MS,
        max_session_timeout_ms: int | None = None,
        heap_mb: int = DEFAULT_HEAP_MB,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
        classpath: str | None = None,
        java: str | None = None,
        stop_with_parent: bool = False,
    ) -> None:
        super().__init__(directory, port=port, stop_with_parent=stop_with_parent)
        self._tick_time_ms = tick_time_ms
        self._max_session_timeout_ms = max_session_timeout_ms
        self._heap_mb = heap_mb
        self._jvm_options = tuple(jvm_options)
        # Resolved now so a missing Java or missing jars fail at construction, loudly.
        self._classpath = classpath if classpath is not None else find_zookeeper_classpath()
        self._java = java if java is not None else find_java()

    # -- properties --------------------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        return self._directory / "zoo.cfg"

    @property
    def log_path(self) -> Path:
        return self._directory / "zookeeper.log"

    @property
    def connect_string(self) -> str:
        """``127.0.0.1:PORT``, for ``KazooClient(hosts=...)``."""
        return f"{HOST}:{self._port}"

    @property
    def min_session_timeout_s(self) -> float:
        """The server clamps requested session timeouts to at least this (2 ticks)."""
        return 2 * self._tick_time_ms / 1000

    @property
    def max_session_timeout_s(self) -> float:
        """The server clamps requested session timeouts to at most this (20 ticks by default)."""
        if self._max_session_timeout_ms is not None:
            return self._max_session_timeout_ms / 1000
        return 20 * self._tick_time_ms / 1000

    @property
    def address(self) -> str:
        return self.connect_string

    def _ready(self) -> bool:
        try:
            answer = four_letter_word(HOST, self._port, "srvr", timeout_s=1.0)
        except OSError:
            return False
        return "Mode:" in answer

    def kill9(self) -> None:
        """SIGKILL (a crash: no clean shutdown). No-op when not running."""
        self._kill_process()

    # -- files and command -------------------------------------------------------------------

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"tickTime={self._tick_time_ms}",
            f"dataDir={self.data_dir}",
            f"clientPort={self._port}",
            f"clientPortAddress={HOST}",
            "maxClientCnxns=0",
            "admin.enableServer=false",
            "4lw.commands.whitelist=srvr,ruok,mntr",
        ]
        if self._max_session_timeout_ms is not None:
            lines.append(f"maxSessionTimeout={self._max_session_timeout_ms}")
        self.config_path.write_text("\n".join(lines) + "\n")
        # Without a config log4j2 logs errors only; INFO makes failed test runs explainable.
        (self._directory / "log4j2.properties").write_text(LOG4J2_CONSOLE_CONFIG)

    def _command(self) -> list[str]:
        return [
            self._java,
            f"-Xmx{self._heap_mb}m",
            *self._jvm_options,
            "-Dzookeeper.jmx.log4j.disable=true",
            f"-Dlog4j2.configurationFile={self._directory / 'log4j2.properties'}",
            "-cp",
            self._classpath,
            _MAIN_CLASS,
            str(self.config_path),
        ]

    def __repr__(self) -> str:
        return f"ZooKeeperServer({self.connect_string}, pid={self.pid}, dir={self._directory})"
