"""A JVM of the engines cache (Apache Pulsar's and BookKeeper's jars, which
clients/dev/pulsar_standalone.py finds) run as a local server: its command
(:func:`jvm_command`: a fixed heap, bounded direct memory, the JDK internals Pulsar's own
``bin/pulsar`` opens, log4j2 from the server's directory), and :class:`GroupJvmProcess`, the
server in a process group of its own, its start bounded and measured, its ports from a port
source (:class:`HeldPort`) given back at close.

The one definition for the Pulsar standalone (clients/dev/pulsar_standalone.py) and the
tests' real cluster harness (tests/support/pulsar_cluster.py: ZooKeeper, bookies, brokers).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self

from clients.dev.local_server import LocalServerProcess, free_port
from clients.dev.zk import ZooKeeperError, find_java

#: Bound of the first start, before one is measured.
FIRST_START_TIMEOUT_S = 180.0
#: Later starts: this many times the first start's measured time...
LATER_START_FACTOR = 4.0
#: ...and never less than this.
LATER_START_MIN_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
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


class EngineError(RuntimeError):
    """An engine's JVM could not be found, started or stopped (details in the message)."""


class HeldPort(Protocol):
    """A port chosen for the server, held (or not) until :meth:`release`."""

    port: int

    def release(self) -> None: ...


@dataclass
class FreePort:
    """A port that was free a moment ago (``bind`` to port 0); nothing holds it."""

    port: int

    def release(self) -> None:
        """Nothing to give back."""


def any_free_port() -> HeldPort:
    """The default port source: a free port, not held."""
    return FreePort(free_port())


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

    error_type: type[Exception] = EngineError
    #: Bound of the first start, before one is measured.
    first_start_timeout_s = FIRST_START_TIMEOUT_S
    # A JVM's start logs a lot; its readiness checks are HTTP or TCP round trips.
    start_log_bytes = 4 * 1024 * 1024
    ready_poll_s = 0.5
    port_taken_markers = ("Address already in use", "BindException")
    _reservations: list[HeldPort]

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

    def kill(self) -> None:
        """The same crash under pulsar-lite's name for it (``PulsarLiteServer.kill``), so
        fault injectors take either engine."""
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
