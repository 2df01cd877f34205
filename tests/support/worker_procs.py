"""Worker subprocesses and a cuttable TCP proxy for end-to-end tests.

Every wait is bounded; processes are killed by pid when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.logged_process import LoggedProcess
from tests.support.procs import HOST, BrokerProcess, free_port, steward_command


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, pause_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(pause_s)


@contextlib.contextmanager
def task_writable_dir(prefix: str = "steward-test-shared-") -> Iterator[Path]:
    """A directory the workers' task users can write, like /tmp (sticky, 1777), removed after.

    Workers run tasks under uids of their own (docs/SECURITY.md, "Task processes"); pytest's
    base temp directory is 0700, so a directory under ``tmp_path`` is out of their reach.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(path, 0o1777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def task_reachable_dir(prefix: str) -> Iterator[Path]:
    """A directory task users can pass through (0711, not list or write) to their homes
    below it, as in a worker's work dir; removed after (task_writable_dir: why not tmp)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(path, 0o711)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class WorkerProcess(LoggedProcess):
    """One ``steward worker`` subprocess."""

    tail_bytes = 4000

    def __init__(
        self,
        *,
        broker: str,
        http_url: str,
        worker_id: str,
        log_dir: Path,
        cache_dir: Path,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        spark: bool = False,
    ) -> None:
        super().__init__(f"worker {worker_id}", log_dir / f"{worker_id}.log")
        self.broker = broker
        self.http_url = http_url
        self.worker_id = worker_id
        self.cache_dir = cache_dir
        # A worker whose tasks may reach Spark starts a Spark Connect server (a JVM): only
        # the tests that use Spark ask for one.
        self.extra_args = extra_args if spark else ("--spark", "off", *extra_args)
        # Added to the environment: secrets (STEWARD_WORKER_TOKEN), never on argv.
        self.env = env or {}

    def start(self) -> WorkerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.spawn_logged(
            [
                *steward_command(),
                "worker",
                "--broker",
                self.broker,
                "--http-url",
                self.http_url,
                "--worker-id",
                self.worker_id,
                "--cache-dir",
                str(self.cache_dir),
                *self.extra_args,
            ],
            env,
        )
        return self

    def wait_connected(self, client: httpx.Client, timeout_s: float = 30.0) -> None:
        def connected() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            workers = client.get("/api/v1/cluster").json()["workers"]
            return any(w["id"] == self.worker_id and w["state"] == "connected" for w in workers)

        wait_until(connected, timeout_s, f"worker {self.worker_id} to connect")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.close_log()


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; ``cut()`` drops every live connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0
        self.bytes_to_client = 0  # forwarded from the target (the broker) to the client
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
                self.connections += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(source, sink, sink is client), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_client: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
                if to_client:
                    with self._lock:
                        self.bytes_to_client += len(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


@contextlib.contextmanager
def broker_with_worker(
    root: Path, worker_id: str, worker_args: tuple[str, ...]
) -> Iterator[tuple[BrokerProcess, WorkerProcess]]:
    """A standalone broker with one worker connected to it (``worker_args``: its task
    types and resources); the worker is stopped and the broker killed at the end."""
    worker_port = free_port()
    broker = BrokerProcess(
        root / "data",
        log_path=root / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{worker_port}"),
    )
    broker.start()
    worker = WorkerProcess(
        broker=f"{HOST}:{worker_port}",
        http_url=broker.url,
        worker_id=worker_id,
        log_dir=root,
        cache_dir=root / "cache",
        extra_args=worker_args,
    ).start()
    try:
        with httpx.Client(base_url=broker.url) as http:
            worker.wait_connected(http)
        yield broker, worker
    finally:
        worker.stop()
        broker.kill9()
