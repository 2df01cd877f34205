"""``steward cluster up`` says the cluster is up only when every broker it lists serves HTTP.

The brokers here are small HTTP servers standing in for ``steward broker`` (the real thing
runs in tests/integration/test_cluster_up.py); the processes are real ``sleep`` ones.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from broker.local_cluster import LocalCluster, LocalClusterConfig, _Child


class _FakeBroker(ThreadingHTTPServer):
    """Answers /healthz and /api/v1/cluster like a broker of a cluster led by broker-1."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self.server_bind()  # the port is taken, but connections are refused until listen()
        self.paths: Counter[str] = Counter()
        self.listening = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def listen(self) -> None:
        self.server_activate()
        self.listening = True
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        if self.listening:
            self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _FakeBroker

    def do_GET(self) -> None:
        self.server.paths[self.path] += 1
        bodies = {
            "/healthz": {"status": "ok", "role": "follower"},
            "/api/v1/cluster": {"leader": "broker-1", "leader_url": "http://leader"},
        }
        body = json.dumps(bodies.get(self.path, {"error": "not_found"})).encode()
        self.send_response(200 if self.path in bodies else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


def _cluster(
    tmp_path: Path, urls: list[str], processes: list[subprocess.Popen[bytes]], argv: list[str]
) -> LocalCluster:
    cluster = LocalCluster(LocalClusterConfig(data_dir=tmp_path))
    for n, url in enumerate(urls, start=1):
        proc = subprocess.Popen(argv)
        processes.append(proc)
        log = open(tmp_path / f"broker-{n}.log", "ab")  # noqa: SIM115 - closed below
        cluster.brokers.append(_Child(f"broker-{n}", proc, log, url=url))
    return cluster


def test_up_waits_until_every_broker_serves(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    ready, slow = _FakeBroker(), _FakeBroker()
    ready.listen()
    cluster = _cluster(tmp_path, [ready.url, slow.url], processes, ["sleep", "60"])
    # broker-2 starts listening 1 s after broker-1 already names the leader.
    timer = threading.Timer(1.0, slow.listen)
    timer.start()
    started = time.monotonic()
    try:
        cluster._wait_until_serving()
        waited_s = time.monotonic() - started
    finally:
        timer.cancel()
        for child in cluster.brokers:
            child.log.close()
        timer.join(timeout=5)
        ready.close()
        slow.close()
    assert slow.paths["/healthz"] >= 1, "returned before broker-2 answered"
    assert waited_s >= 1.0
    assert "leader      broker-1 http://leader" in capsys.readouterr().out


def test_up_names_a_broker_that_exited(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    silent = _FakeBroker()
    cluster = _cluster(tmp_path, [silent.url], processes, ["sh", "-c", "exit 3"])
    processes[0].wait(timeout=10)
    try:
        with pytest.raises(RuntimeError, match=r"broker-1 exited with 3; see .*broker-1\.log"):
            cluster._wait_until_serving()
    finally:
        cluster.brokers[0].log.close()
        silent.close()
