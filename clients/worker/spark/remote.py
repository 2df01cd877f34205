"""A remote Spark Connect server instead of the worker's own (``--spark-remote``).

``steward worker --spark-remote sc://HOST:PORT[/;token=...]`` makes every PySpark task's
``ctx.spark`` a Spark Connect session of its own (a fresh session id per attempt, user id
``steward``) on that server; the worker starts no Spark JVM. The URL, token included,
reaches a task process only in its Run frame (clients/worker/task_processes/pipe_protocol.py),
never its
environment or command line (docs/SECURITY.md, "Remote Spark Connect").

Failing clearly instead of hanging: the worker probes the server when it starts and logs
what it found; a task's process checks that the server accepts a TCP connection (bounded)
before pyspark, whose client retries an unreachable server for minutes, opens a session.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Final

from clients.worker.spark.connect_server import (
    SparkConnectError,
    interrupt_session,
    new_session_id,
    open_session,
)
from clients.worker.spark_remote_url import parse_remote

logger = logging.getLogger("clients.worker.spark")

#: How long a task (or the worker's start-up probe) waits for a TCP connection to the server.
CONNECT_TIMEOUT_S: Final = 10.0


def check_reachable(host: str, port: int, timeout_s: float, address: str) -> None:
    """SparkConnectError unless ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return
    except OSError as exc:
        raise SparkConnectError(
            f"the Spark Connect server {address} (--spark-remote) is unreachable: {exc}"
        ) from None


def remote_session(url: str, session_id: str, pool: str, timeout_s: float) -> Any:
    """A task process's session on the remote server (``url``: the Run frame's)."""
    remote = parse_remote(url)
    check_reachable(remote.host, remote.port, timeout_s, remote.address)
    return open_session(remote.session_url(session_id), pool)


class RemoteSpark:
    """The worker's side of a remote server: the URL for Run frames, a start-up probe and
    the interrupt of a dead attempt's session (the interface runtime/process_runs.py uses)."""

    def __init__(self, url: str, *, probe_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.remote = parse_remote(url)
        self.url = url
        self.probe_timeout_s = probe_timeout_s
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Probe the server in the background: the log says at once if it is not usable."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._probe, name="steward-spark-remote-probe", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        return None  # not ours to stop

    def set_tenant_weights(self, weights: Any) -> None:
        return None  # the remote server's pools are its operator's (docs/DESIGN.md §6)

    def error(self) -> str | None:
        return None  # each task finds out for itself (the server may come and go)

    def wait_left_s(self) -> float:
        return self.probe_timeout_s

    def _probe(self) -> None:
        started = time.monotonic()
        try:
            check_reachable(
                self.remote.host, self.remote.port, self.probe_timeout_s, self.remote.address
            )
            session = self.attach(new_session_id())
            try:
                session.range(1).collect()
            finally:
                with contextlib.suppress(Exception):
                    session.stop()
        except Exception as exc:
            logger.error(
                "the Spark Connect server %s is not usable: %s; PySpark tasks fail on this"
                " worker until it is",
                self.remote.address,
                str(exc).split("\n", 1)[0],
            )
            return
        logger.info(
            "Spark Connect server %s answers (%.1f s)",
            self.remote.address,
            time.monotonic() - started,
        )

    def attach(self, session_id: str) -> Any:
        from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

        return RemoteSparkSession(connection=self.remote.session_url(session_id))

    def interrupt(self, session_id: str) -> None:
        """Interrupt a dead attempt's operations and release its session."""
        check_reachable(
            self.remote.host, self.remote.port, self.probe_timeout_s, self.remote.address
        )
        interrupt_session(self.attach(session_id))
