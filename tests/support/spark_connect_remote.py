"""A Spark Connect server in a process of its own, from pyspark's jars (issue 20 item 3).

``RemoteConnectServer`` runs ``spark-submit --class ...SparkConnectServer spark-internal``
on 127.0.0.1 with a random token (in its environment only), ``local[2]`` and 512 MiB of
driver memory; it serves in about 5 s. ``url`` is what a worker's ``--spark-remote`` takes.
A missing pyspark or Java fails the test loudly (no skip).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clients.worker.spark.connect_server import SERVER_CLASS, TOKEN_ENV, free_port, spark_home
from tests.support.logged_process import log_tail, open_log

START_TIMEOUT_S = 120.0


class RemoteConnectServer:
    def __init__(self, directory: Path, *, ui_port: int | None = None) -> None:
        self.directory = directory
        self.port = free_port()
        self.token = secrets.token_urlsafe(24)
        self.ui_port = ui_port
        self.log_path = directory / "remote-connect.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        # Host "localhost": pyspark sends a token without TLS only there.
        return f"sc://localhost:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.address}/;token={self.token}"

    def start(self) -> None:
        home = spark_home()
        self.directory.mkdir(parents=True, exist_ok=True)
        ui = (
            ["--conf", "spark.ui.enabled=true", "--conf", f"spark.ui.port={self.ui_port}"]
            if self.ui_port
            else ["--conf", "spark.ui.enabled=false"]
        )
        command = [
            os.path.join(home, "bin", "spark-submit"),
            "--class",
            SERVER_CLASS,
            "--master",
            "local[2]",
            "--driver-memory",
            "512m",
            "--conf",
            "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf",
            f"spark.connect.grpc.binding.port={self.port}",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.driver.bindAddress=127.0.0.1",
            "--conf",
            f"spark.local.dir={self.directory}",
            "--conf",
            f"spark.sql.warehouse.dir={self.directory / 'warehouse'}",
            *ui,
            "spark-internal",
        ]
        env = {**os.environ, "SPARK_HOME": home, TOKEN_ENV: self.token}
        log = open_log(self.log_path)
        try:
            self.proc = subprocess.Popen(
                command,
                env=env,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.wait_listening()

    def wait_listening(self) -> None:
        import socket

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the Spark Connect server exited ({self.proc.returncode}):\n"
                    + log_tail(self.log_path, 4000)
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Spark Connect server did not listen within {START_TIMEOUT_S:.0f} s:\n"
                    + log_tail(self.log_path, 4000)
                )
            time.sleep(0.1)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(10.0)
                return
            except subprocess.TimeoutExpired:
                continue


@contextmanager
def remote_connect_server(
    directory: Path, *, ui_port: int | None = None
) -> Iterator[RemoteConnectServer]:
    """A started server, stopped (its whole process group) on every exit path."""
    server = RemoteConnectServer(directory, ui_port=ui_port)
    try:
        server.start()
        yield server
    finally:
        server.stop()
