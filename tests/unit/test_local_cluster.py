"""``steward cluster up`` says the cluster is up only when every broker it lists serves HTTP.

The brokers here are small HTTP servers standing in for ``steward broker`` (the real thing
runs in tests/integration/test_cluster_up.py); the processes are real ``sleep`` ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from clients.dev.local_cluster import LocalCluster, LocalClusterConfig, _Child


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


class _Launcher:
    """Starts stand-in broker processes the way LocalCluster does: output into
    ``DATA_DIR/logs/NAME.log``, where the cluster reads why one exited."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.processes: list[subprocess.Popen[bytes]] = []

    def child(self, name: str, url: str, argv: list[str]) -> _Child:
        log_path = self.cluster._log_path(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")  # noqa: SIM115 - closed by close()
        offset = log.seek(0, os.SEEK_END)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(proc)
        return _Child(name, proc, log, url=url, log_offset=offset)

    def close(self) -> None:
        for proc in self.processes:
            proc.kill()
            proc.wait(timeout=10)
        for child in self.cluster.brokers:
            child.log.close()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[_Launcher]:
    started = _Launcher(LocalCluster(LocalClusterConfig(data_dir=tmp_path)))
    yield started
    started.close()


def _cluster(launcher: _Launcher, urls: list[str], argv: list[str]) -> LocalCluster:
    for n, url in enumerate(urls, start=1):
        launcher.cluster.brokers.append(launcher.child(f"broker-{n}", url, argv))
    return launcher.cluster


def test_up_waits_until_every_broker_serves(
    launcher: _Launcher, capsys: pytest.CaptureFixture[str]
) -> None:
    ready, slow = _FakeBroker(), _FakeBroker()
    ready.listen()
    cluster = _cluster(launcher, [ready.url, slow.url], ["sleep", "60"])
    # broker-2 starts listening 1 s after broker-1 already names the leader.
    timer = threading.Timer(1.0, slow.listen)
    timer.start()
    started = time.monotonic()
    try:
        cluster._wait_until_serving()
        waited_s = time.monotonic() - started
    finally:
        timer.cancel()
        timer.join(timeout=5)
        ready.close()
        slow.close()
    assert slow.paths["/healthz"] >= 1, "returned before broker-2 answered"
    assert waited_s >= 1.0
    assert "leader      broker-1 http://leader" in capsys.readouterr().out


def test_up_names_a_broker_that_exited(launcher: _Launcher) -> None:
    silent = _FakeBroker()
    cluster = _cluster(launcher, [silent.url], ["sh", "-c", "echo 'no such ledger'; exit 3"])
    launcher.processes[0].wait(timeout=10)
    try:
        with pytest.raises(RuntimeError, match=r"broker-1 exited with 3; see .*broker-1\.log"):
            cluster._wait_until_serving()
    finally:
        silent.close()


PORT_TAKEN = ["sh", "-c", "echo 'steward: could not serve HTTP on 127.0.0.1:1'; exit 2"]


def _exited_broker(launcher: _Launcher, argv: list[str]) -> LocalCluster:
    """A cluster whose one broker ran ``argv`` and exited. An earlier start left a
    port-taken line in its log: only the lines of this start may count."""
    log = launcher.cluster._log_path("broker-1")
    log.parent.mkdir(parents=True)
    log.write_text("steward: could not serve HTTP on 127.0.0.1:9 (an earlier start)\n")
    cluster = _cluster(launcher, ["http://127.0.0.1:1"], argv)
    launcher.processes[0].wait(timeout=10)
    return cluster


def test_up_restarts_a_broker_whose_free_port_was_taken(
    launcher: _Launcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = _FakeBroker()
    serving.listen()
    cluster = _exited_broker(launcher, PORT_TAKEN)
    respawned: list[tuple[str, int]] = []

    def spawn_broker(name: str, port: int) -> _Child:
        respawned.append((name, port))
        return launcher.child(name, serving.url, ["sleep", "60"])

    monkeypatch.setattr(cluster, "_spawn_broker", spawn_broker)
    try:
        cluster._wait_until_serving()
    finally:
        serving.close()
    assert [name for name, _ in respawned] == ["broker-1"]
    assert cluster.brokers[0].url == serving.url
    assert serving.paths["/healthz"] >= 1


def test_up_does_not_move_a_broker_off_a_port_the_user_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _Launcher(
        LocalCluster(LocalClusterConfig(data_dir=tmp_path, first_http_port=18_080))
    )
    cluster = _exited_broker(launcher, PORT_TAKEN)
    monkeypatch.setattr(cluster, "_spawn_broker", lambda *_: pytest.fail("respawned"))
    try:
        with pytest.raises(RuntimeError, match="broker-1 exited with 2"):
            cluster._wait_until_serving()
    finally:
        launcher.close()


def test_a_broker_whose_log_says_nothing_of_its_port_is_not_respawned(
    launcher: _Launcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _exited_broker(launcher, ["sh", "-c", "exit 4"])
    monkeypatch.setattr(cluster, "_spawn_broker", lambda *_: pytest.fail("respawned"))
    with pytest.raises(RuntimeError, match="broker-1 exited with 4"):
        cluster._wait_until_serving()
