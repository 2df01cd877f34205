"""The worker's test harness: a fake broker speaking wire.worker_protocol on 127.0.0.1:0
that lets each test decide what to answer, an artifact server (a real HTTP server on
127.0.0.1:0), the :class:`Env` holding both and the workers a test starts, and helpers to
build assignments and read reports. Used by tests/unit/test_worker.py and the Spark tests
(tests/integration/test_worker_spark.py, tests/integration/test_spark_connect.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import threading
import time
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from clients.worker import Worker, WorkerConfig
from wire.worker_protocol import (
    Assign,
    AssignedTask,
    Finish,
    FinishAck,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    TaskAttempt,
    TaskReport,
    Welcome,
    encode_message,
)

WAIT_S = 5.0
M = TypeVar("M", bound=Message)


# -- fake broker --


class BrokerConn:
    """One accepted worker connection: frames in a queue, frames out with send()."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.closed = asyncio.Event()
        self.hello: Hello | None = None
        self.heartbeats = 0
        self._task = asyncio.ensure_future(self._read())
        self._heartbeats: asyncio.Future[None] | None = None

    async def _read(self) -> None:
        decoder = FrameDecoder()
        try:
            while data := await self.reader.read(65536):
                for message in decoder.feed(data):
                    if isinstance(message, Heartbeat):
                        self.heartbeats += 1
                    else:
                        await self.messages.put(message)
        except (ConnectionError, ProtocolError):
            pass
        finally:
            self.closed.set()

    def send(self, message: Message) -> None:
        self.writer.write(encode_message(message))

    def welcome(self, *, heartbeats: bool = True, **kwargs: Any) -> None:
        """Send Welcome; then heartbeat every interval, as a broker does, unless told not to."""
        kwargs.setdefault("heartbeat_interval_ms", 100)
        kwargs.setdefault("heartbeat_timeout_ms", 5000)
        welcome = Welcome(broker_id="fake", **kwargs)
        self.send(welcome)
        if heartbeats:
            self._heartbeats = asyncio.ensure_future(self._beat(welcome.heartbeat_interval_ms))

    async def _beat(self, interval_ms: int) -> None:
        seq = 0
        while not self.closed.is_set() and not self.writer.is_closing():
            seq += 1
            self.send(Heartbeat(seq=seq))
            await asyncio.sleep(interval_ms / 1000)

    def assign(self, *tasks: AssignedTask) -> None:
        self.send(Assign(tasks=tasks))

    async def next(self, kind: type[M], timeout_s: float = WAIT_S) -> M:
        message = await asyncio.wait_for(self.messages.get(), timeout_s)
        assert isinstance(message, kind), f"expected {kind.__name__}, got {message!r}"
        return message

    async def reports(
        self, n: int, timeout_s: float = WAIT_S, *, ack: bool = True
    ) -> dict[tuple[int, int], TaskReport]:
        """Collect Finish reports until ``n`` distinct attempts arrived (acking them)."""
        got: dict[tuple[int, int], TaskReport] = {}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(got) < n:
            left = deadline - asyncio.get_running_loop().time()
            finish = await self.next(Finish, max(0.01, left))
            for report in finish.reports:
                got[(report.task_id, report.attempt)] = report
            if ack:
                self.send(
                    FinishAck(
                        tasks=tuple(TaskAttempt(r.task_id, r.attempt) for r in finish.reports)
                    )
                )
        return got

    async def report(self, timeout_s: float = WAIT_S) -> TaskReport:
        (report,) = (await self.reports(1, timeout_s)).values()
        return report

    async def report_for(self, task_id: int, timeout_s: float = WAIT_S) -> TaskReport:
        """The report of ``task_id``, skipping others' (a report the worker sends again
        before our acknowledgement reached it, for one)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            for report in (await self.reports(1, max(0.01, left))).values():
                if report.task_id == task_id:
                    return report

    async def expect_silence(self, seconds: float) -> None:
        """No non-heartbeat frame for ``seconds``."""
        with pytest.raises(TimeoutError):
            message = await asyncio.wait_for(self.messages.get(), seconds)
            raise AssertionError(f"unexpected {message!r}")

    async def close(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        self.writer.close()
        await asyncio.wait_for(self.closed.wait(), WAIT_S)


class FakeBroker:
    def __init__(self) -> None:
        self.conns: asyncio.Queue[BrokerConn] = asyncio.Queue()
        self.all: list[BrokerConn] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = BrokerConn(reader, writer)
        self.all.append(conn)
        conn.hello = await conn.next(Hello)
        await self.conns.put(conn)

    async def accept(self, timeout_s: float = WAIT_S) -> BrokerConn:
        """The next connection whose Hello arrived (not yet welcomed)."""
        return await asyncio.wait_for(self.conns.get(), timeout_s)

    async def connect(self, **welcome: Any) -> BrokerConn:
        conn = await self.accept()
        conn.welcome(**welcome)
        return conn

    async def close(self) -> None:
        for conn in self.all:
            if conn._heartbeats is not None:
                conn._heartbeats.cancel()
            conn.writer.close()
        if self._server is not None:
            self._server.close()
            await asyncio.wait_for(self._server.wait_closed(), WAIT_S)


# -- HTTP servers --


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers with :meth:`reply`."""

    def reply(self, status: int, body: bytes = b"", content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class HttpServer:
    """A threaded HTTP server on 127.0.0.1:0 with ``handler``; ``start()`` serves it."""

    def __init__(self, handler: type[QuietHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class ArtifactServer(HttpServer):
    """Serves ``GET /api/v1/code/<sha>`` from ``files``; counts requests per sha."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: dict[str, int] = {}
        self.delay_s = 0.0
        server = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                sha = self.path.rsplit("/", 1)[-1]
                server.requests[sha] = server.requests.get(sha, 0) + 1
                time.sleep(server.delay_s)
                body = server.files.get(sha)
                if not self.path.startswith("/api/v1/code/") or body is None:
                    self.reply(404)
                    return
                self.reply(200, body, "application/octet-stream")

        super().__init__(Handler)

    def add(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.files[sha] = data
        return sha


def zip_bytes(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


# -- fixtures --


@dataclass
class Env:
    broker: FakeBroker
    http: ArtifactServer
    tmp: Path
    workers: list[tuple[Worker, asyncio.Task[None]]] = field(default_factory=list)

    def worker_settings(self, **overrides: Any) -> dict[str, Any]:
        """A worker's settings for this fake broker and artifact server: quick batching,
        backoff and cancel grace; ``overrides`` win."""
        settings: dict[str, Any] = {
            "broker": f"127.0.0.1:{self.broker.port}",
            "http_url": self.http.url,
            "worker_id": "w1",
            "task_types": {"*": 4},
            "resources": {"cpu": 4.0, "memory_mb": 1024.0},
            "cache_dir": self.tmp / "cache",
            "finish_batch_ms": 2.0,
            "reconnect_backoff_min_s": 0.02,
            "reconnect_backoff_max_s": 0.2,
            "cancel_grace_s": 2.0,
        }
        settings.update(overrides)
        return settings

    def worker(self, **overrides: Any) -> Worker:
        # These tests are about the link and the runtime's bookkeeping; tasks in task
        # processes are tested in tests/security/test_task_processes.py.
        settings = self.worker_settings(**{"task_isolation": "thread", **overrides})
        worker = Worker(WorkerConfig(**settings))
        self.workers.append((worker, asyncio.ensure_future(worker.run())))
        return worker

    async def started(self, **overrides: Any) -> tuple[Worker, BrokerConn]:
        """A worker connected to the fake broker and welcomed."""
        worker = self.worker(**overrides)
        conn = await self.broker.connect()
        await asyncio.wait_for(worker.wait_connected(), WAIT_S)
        return worker, conn


@asynccontextmanager
async def worker_env(
    tmp_path: Path, stop_timeout_s: float, stop_wait_s: float
) -> AsyncIterator[Env]:
    """A started fake broker and artifact server; on leaving, every worker the test started
    is stopped (``stop_timeout_s`` for its tasks, ``stop_wait_s`` in all), then both."""
    broker = FakeBroker()
    await broker.start()
    http = ArtifactServer()
    http.start()
    environment = Env(broker, http, tmp_path)
    try:
        yield environment
    finally:
        for worker, task in environment.workers:
            await asyncio.wait_for(worker.stop(wait=False, timeout_s=stop_timeout_s), stop_wait_s)
            await asyncio.wait_for(task, WAIT_S)
        await broker.close()
        http.stop()


def task(
    task_id: int,
    type_: str = "noop",
    params: Any = None,
    *,
    attempt: int = 1,
    tenant: str = "acme",
    code: str | None = None,
    deadline_ms: int | None = None,
) -> AssignedTask:
    return AssignedTask(
        task_id=task_id,
        attempt=attempt,
        type=type_,
        tenant=tenant,
        params=json.dumps(params).encode(),
        code=code,
        deadline_ms=deadline_ms,
    )


def result_of(report: TaskReport) -> Any:
    assert report.ok, report.error
    assert report.result is not None
    return json.loads(report.result)


async def until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    async def poll() -> None:
        while True:  # the condition may change on other threads: poll it
            if condition():
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)
