"""A Spark standalone cluster on 127.0.0.1 from pyspark's own ``spark-class``: one master and
one or more Spark workers, each a process group of its own (issue 20, item 2).

The pyspark wheel ships Spark's jars and ``bin/``: no download, no Docker. Every wait is
bounded; :meth:`SparkCluster.stop` kills every group it started (the JVMs and the executors
the workers forked) and is called on every exit path by :func:`spark_cluster`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clients.worker.spark.connect_server import spark_home
from tests.support.logged_process import log_tail, open_log
from tests.support.procs import HOST, free_port

START_TIMEOUT_S = 90.0  # a JVM start on a loaded 2-core machine
WORKER_MEMORY = "1g"  # what a Spark worker offers; executors take spark.executor.memory
EXECUTOR_MEMORY = "512m"
# Short-lived JVMs on a shared machine: the C1 compiler alone and one GC thread start them
# with a fraction of the CPU (C2's compiler threads otherwise compete with the tests).
LEAN_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


class SparkClusterError(AssertionError):
    """The cluster did not come up (with the logs' tails)."""


@dataclass
class SparkProcess:
    name: str
    command: list[str]
    log_path: Path
    webui_port: int
    proc: subprocess.Popen[bytes] | None = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return f"--- {self.name} ({self.log_path}) ---\n{log_tail(self.log_path, 3000)}"


@dataclass
class SparkCluster:
    """The master and its workers; ``master_url`` is ``spark://127.0.0.1:PORT``."""

    root: Path
    master_port: int = field(default_factory=free_port)
    master_ui_port: int = field(default_factory=free_port)
    master: SparkProcess | None = None
    workers: list[SparkProcess] = field(default_factory=list)

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.master_port}"

    @property
    def master_ui(self) -> str:
        return f"http://{HOST}:{self.master_ui_port}"

    def driver_conf(self) -> dict[str, str]:
        """The ``--spark-conf`` a Steward worker uses on this cluster: bounded, lean executors
        (and a lean driver: ``defaultJavaOptions`` keep the worker's own extraJavaOptions)."""
        return {
            "spark.executor.memory": EXECUTOR_MEMORY,
            "spark.executor.cores": "1",
            "spark.executor.defaultJavaOptions": LEAN_JVM_OPTIONS,
            "spark.driver.defaultJavaOptions": LEAN_JVM_OPTIONS,
        }

    # -- processes --

    def _env(self, name: str) -> dict[str, str]:
        work = self.root / name
        (work / "work").mkdir(parents=True, exist_ok=True)
        return dict(
            os.environ,
            SPARK_HOME=spark_home(),
            SPARK_LOCAL_IP=HOST,  # every JVM binds to loopback
            SPARK_WORKER_DIR=str(work / "work"),
            SPARK_LOG_DIR=str(work),
            SPARK_PID_DIR=str(work),
            SPARK_NO_DAEMONIZE="1",
            # Small daemons: the executors are the ones that work.
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS=LEAN_JVM_OPTIONS,
        )

    def _spawn(self, process: SparkProcess) -> SparkProcess:
        log = open_log(process.log_path, f"$ {' '.join(process.command)}\n")
        try:
            process.proc = subprocess.Popen(
                process.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(process.name),
                cwd=self.root,
                start_new_session=True,  # its own group: the JVM and what it forks
            )
        finally:
            log.close()
        return process

    def start_master(self) -> None:
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        self.master = self._spawn(
            SparkProcess(
                "spark-master",
                [
                    spark_class,
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    HOST,
                    "--port",
                    str(self.master_port),
                    "--webui-port",
                    str(self.master_ui_port),
                ],
                self.root / "spark-master.log",
                self.master_ui_port,
            )
        )

    def start_worker(self) -> SparkProcess:
        """One more Spark worker (1 core, :data:`WORKER_MEMORY`); not waited for."""
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        index = len(self.workers) + 1
        ui_port = free_port()
        worker = self._spawn(
            SparkProcess(
                f"spark-worker-{index}",
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    HOST,
                    "--webui-port",
                    str(ui_port),
                    "--memory",
                    WORKER_MEMORY,
                    "--cores",
                    "1",
                    self.master_url,
                ],
                self.root / f"spark-worker-{index}.log",
                ui_port,
            )
        )
        self.workers.append(worker)
        return worker

    def kill9(self, process: SparkProcess) -> None:
        """SIGKILL the process's whole group (its executors die with it), reaped (bounded)."""
        if process.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.proc.wait(timeout=10)

    def stop(self) -> None:
        for process in [*self.workers, *([self.master] if self.master else [])]:
            self.kill9(process)

    # -- the master's view --

    def state(self) -> dict[str, Any]:
        """The master's ``/json/``: its workers and applications."""
        response = httpx.get(f"{self.master_ui}/json/", timeout=5)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def alive_workers(self) -> list[dict[str, Any]]:
        try:
            workers: list[dict[str, Any]] = self.state().get("workers", [])
        except (httpx.HTTPError, ValueError):
            return []
        return [w for w in workers if w.get("state") == "ALIVE"]

    def _master_answers(self) -> bool:
        try:
            self.state()
        except (httpx.HTTPError, ValueError):
            return False
        return True

    def wait_master(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the master answers on its UI (it takes registrations by then)."""
        self._wait(self._master_answers, f"the master at {self.master_url}", timeout_s)

    def wait_workers(self, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``count`` workers are alive at the master; SparkClusterError with logs."""
        self._wait(
            lambda: len(self.alive_workers()) >= count,
            f"{count} Spark workers alive at {self.master_url}",
            timeout_s,
        )

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p for p in [self.master, *self.workers] if p is not None and not p.running()]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0].name} exited" if dead else f"not within {timeout_s:.0f} s"
                raise SparkClusterError(f"no {what}: {why}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(p.tail() for p in [self.master, *self.workers] if p is not None)


@contextlib.contextmanager
def spark_cluster(root: Path, workers: int = 1, *, wait: bool = True) -> Iterator[SparkCluster]:
    """A master (up) and ``workers`` Spark workers (alive at the master, or with ``wait``
    False still starting: a driver may start meanwhile); all stopped on exit.

    Fails (never skips) when Java or pyspark's ``spark-class`` is missing.
    """
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise SparkClusterError("Java is missing: a Spark cluster needs a JVM (JAVA_HOME)")
    if not os.access(os.path.join(spark_home(), "bin", "spark-class"), os.X_OK):
        raise SparkClusterError(f"pyspark at {spark_home()} has no executable bin/spark-class")
    cluster = SparkCluster(root)
    try:
        cluster.start_master()
        cluster.wait_master()
        for _ in range(workers):
            cluster.start_worker()
        if wait:
            cluster.wait_workers(workers)
        yield cluster
    finally:
        cluster.stop()
