"""Issue 7, acceptance 5: TLS end to end with a certificate made at test time (trustme).

Real ``steward standalone`` / ``steward broker`` / ``steward worker`` processes, a real
ZooKeeper, the Python client and the CLI:

- standalone: HTTPS API and TLS worker endpoint; a worker connects over TLS and
  downloads a code artifact over HTTPS; the client and the CLI submit with the CA, and
  the task's result is read back;
- cluster: three brokers advertise https:// URLs; a client given only a follower's URL
  follows the leader over HTTPS; followers fetch code artifacts from their peers over
  HTTPS; after ``kill -9`` of the leader a follower takes over, the worker finds it and
  reconnects over TLS, and every task is still there;
- refused: a client without the CA (the CLI prints one ``steward: ...`` line), plain
  HTTP to the HTTPS port, a worker speaking plain TCP to the TLS worker port; the broker
  keeps serving the others.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import CertificateVerifyError, StewardClient
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import BrokerNode, ClusterProcesses
from tests.support.cluster_up import ClusterUpOutput, descendants
from tests.support.procs import HOST, BrokerProcess, free_port, steward_command
from tests.support.tls_certs import TlsFiles, make_tls_files
from tests.support.worker_procs import WorkerProcess, wait_until
from tests.support.write_load import fetch_tasks
from wire import worker_protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOB = b"def run(params, ctx):\n    return {'echo': params, 'task': ctx.task_id}\n"
TASK_TIMEOUT_S = 60.0
CLI_TIMEOUT_S = 60.0
CLUSTER_UP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def run_cli(*args: str, ca_env: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STEWARD_TLS_CA", "STEWARD_URL")}
    if ca_env is not None:
        env["STEWARD_TLS_CA"] = str(ca_env)
    return subprocess.run(
        [*steward_command(), *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=env,
        check=False,
    )


def assert_one_certificate_error_line(result: subprocess.CompletedProcess[str], url: str) -> None:
    assert result.returncode == 1, result
    assert result.stdout == "", result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"steward: cannot reach {url}: certificate verify failed"), lines
    assert "--ca-file" in lines[0], lines


# -- standalone ------------------------------------------------------------------------------


class Standalone:
    def __init__(self, broker: BrokerProcess, worker_port: int, tls: TlsFiles, root: Path) -> None:
        self.broker = broker
        self.worker_address = f"{HOST}:{worker_port}"
        self.tls = tls
        self.root = root
        self.http = httpx.Client(base_url=broker.url, timeout=30, verify=tls.client_context())

    def worker(self, worker_id: str, *args: str) -> WorkerProcess:
        return WorkerProcess(
            broker=self.worker_address,
            http_url=self.broker.url,
            worker_id=worker_id,
            log_dir=self.root / "logs",
            cache_dir=self.root / "cache" / worker_id,
            extra_args=args,
        ).start()

    def connected(self) -> set[str]:
        workers = self.http.get("/api/v1/cluster").json()["workers"]
        return {w["id"] for w in workers if w["state"] == "connected"}


@pytest.fixture
def standalone(tls: TlsFiles, tmp_path: Path) -> Iterator[Standalone]:
    worker_port = free_port()
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "logs" / "broker.log",
        tls=tls,
        extra_args=("--worker-listen", f"{HOST}:{worker_port}"),
    )
    with broker:
        broker.start()
        setup = Standalone(broker, worker_port, tls, tmp_path)
        try:
            yield setup
        finally:
            setup.http.close()


def test_standalone_worker_client_and_cli_over_tls(standalone: Standalone, tls: TlsFiles) -> None:
    url = standalone.broker.url
    assert url.startswith("https://")
    assert "ready on https://" in standalone.broker.log_text()
    worker = standalone.worker("tls-w1", "--tls", "--tls-ca", str(tls.ca_path))
    try:
        worker.wait_connected(standalone.http)
        with StewardClient(url, ca_file=tls.ca_path) as client:
            sha256 = client.upload_code(_job_file(standalone.root))
            handle = client.submit("tlsjob:run", {"n": 1}, tenant="tls", code=sha256)
            # The worker downloaded the artifact over HTTPS and ran it.
            assert handle.result(timeout=TASK_TIMEOUT_S) == {"echo": {"n": 1}, "task": handle.id}

        # The CLI: --ca-file, then the environment variable.
        submitted = run_cli(
            "--url", url, "--ca-file", str(tls.ca_path), "submit", "noop", "--tenant", "tls",
            "--wait", "--timeout-s", str(TASK_TIMEOUT_S),
        )  # fmt: skip
        assert submitted.returncode == 0, submitted
        word, task_id, state = submitted.stdout.split()[:3]
        assert (word, state) == ("task", "finished"), submitted.stdout
        shown = run_cli("--url", url, "task", task_id, "--json", ca_env=tls.ca_path)
        assert shown.returncode == 0, shown
        assert '"state": "finished"' in shown.stdout
        assert '"worker": "tls-w1"' in shown.stdout

        # Without the CA: one clear line, no traceback.
        refused = run_cli("--url", url, "submit", "noop", "--tenant", "tls")
        assert_one_certificate_error_line(refused, url)
        with StewardClient(url) as client, pytest.raises(CertificateVerifyError):
            client.submit("noop", tenant="tls")
    finally:
        worker.stop()


def _job_file(directory: Path, suffix: bytes = b"") -> Path:
    path = directory / "job" / "tlsjob.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(JOB + suffix)
    return path


def _plain_hello(worker_id: str) -> bytes:
    hello = p.Hello(worker_id=worker_id, process_id="plain", version="0.1.0", task_types={"*": 1})
    return p.encode_message(hello, p.DEFAULT_MAX_FRAME_BYTES)


def test_plain_connections_to_tls_ports_are_refused(standalone: Standalone, tls: TlsFiles) -> None:
    url = standalone.broker.url
    good = standalone.worker("tls-good", "--tls", "--tls-ca", str(tls.ca_path), "--tenant", "t2")
    plain_worker = standalone.worker("plain-worker", "--tenant", "t2")
    try:
        good.wait_connected(standalone.http)

        # Plain HTTP to the HTTPS port.
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https://", "http://") + "/healthz", timeout=10)

        # A plain-TCP Hello to the TLS worker port: the connection is closed, no Welcome.
        host, port = standalone.worker_address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(_plain_hello("raw-plain"))
            received = b""
            while chunk := sock.recv(65536):  # the socket timeout bounds each read
                received += chunk
        assert b"Welcome" not in received and b"welcome" not in received

        # A real worker without --tls keeps failing to connect (it retries with backoff).
        wait_until(
            lambda: (
                "closed the connection before Welcome (a TLS endpoint? use --tls)"
                in plain_worker.log_tail()
            ),
            30,
            "the plain worker's failed connection",
        )
        assert plain_worker.proc is not None and plain_worker.proc.poll() is None
        connected = standalone.connected()
        assert "plain-worker" not in connected and "raw-plain" not in connected
        assert "tls-good" in connected

        # The broker keeps serving: a task still runs on the TLS worker.
        with StewardClient(url, ca_file=tls.ca_path) as client:
            handle = client.submit("noop", tenant="t2")
            task = handle.wait(TASK_TIMEOUT_S)
        assert (task["state"], task["worker"]) == ("finished", "tls-good"), task
    finally:
        plain_worker.stop()
        good.stop()


# -- cluster --------------------------------------------------------------------------------


def _fetched_from_peer(node: BrokerNode, sha256: str) -> bool:
    return f"code artifact {sha256} fetched from https://" in node.log_text()


def _submit_jobs(client: StewardClient, sha256: str, count: int, tag: str) -> dict[int, Any]:
    handles = [
        client.submit("tlsjob:run", {"tag": tag, "n": n}, tenant="tls", code=sha256)
        for n in range(count)
    ]
    return {h.id: h.result(timeout=TASK_TIMEOUT_S) for h in handles}


def test_cluster_over_tls_survives_kill9_of_the_leader(
    zookeeper: ZooKeeperServer, tls: TlsFiles, tmp_path: Path
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path, tls=tls) as cluster:
        leader = cluster.wait_for_leader(30)
        follower, other = [node for node in cluster.live() if node is not leader]
        summary = follower.get_json("/api/v1/cluster")
        assert summary["leader_url"] == leader.url and leader.url.startswith("https://")
        assert summary["leader_worker_tls"] is True
        assert all(b["url"].startswith("https://") for b in summary["brokers"]), summary
        # Brokers ask each other's /healthz over HTTPS, verified by the cluster's CA.
        wait_until(
            lambda: all(b["reachable"] for b in follower.get_json("/api/v1/cluster")["brokers"]),
            30,
            "the follower to reach every peer over HTTPS",
        )

        cluster.start_worker("tls-cw1")
        cluster.wait_workers_connected(["tls-cw1"], 60)

        # Only a follower's URL: the client follows the 307 to the leader, over HTTPS.
        client = StewardClient(
            [follower.url, other.url, leader.url], ca_file=tls.ca_path, failover_timeout_s=60
        )
        with client:
            sha256 = client.upload_code(_job_file(tmp_path))
            assert client.leader_url == leader.url
            before = _submit_jobs(client, sha256, 10, "before")
            for task_id, result in before.items():
                assert result["task"] == task_id
            # Both followers fetched the artifact from a peer over HTTPS.
            wait_until(
                lambda: all(_fetched_from_peer(n, sha256) for n in (follower, other)),
                30,
                "both followers to fetch the artifact",
            )

            old_id = leader.broker_id
            leader.kill9()
            new = cluster.wait_for_leader(30, excluding=[old_id])
            assert new.url.startswith("https://")
            # The worker asks the brokers over HTTPS and reconnects to the new leader over TLS.
            assert cluster.wait_workers_connected(["tls-cw1"], 60) is new
            # The client's remembered leader is dead: it fails over to the others (HTTPS).
            after = _submit_jobs(client, sha256, 10, "after")

            # The new leader serves peers over HTTPS: the remaining follower fetches a new
            # artifact from it.
            second = client.upload_code(_job_file(tmp_path, b"# v2\n"))
            remaining = follower if new is other else other
            wait_until(lambda: _fetched_from_peer(remaining, second), 30, "fetch from new leader")

        tasks = fetch_tasks(new, tenant="tls")
        assert set(before) | set(after) <= set(tasks), sorted(set(before) | set(after) - set(tasks))
        for task_id in (*before, *after):
            assert tasks[task_id]["state"] == "finished", tasks[task_id]
        digest = cluster.wait_for_equal_digests(30)
        worker_log = cluster.workers[0].log_tail(20_000)
        assert "the leader's worker endpoint is" in worker_log
        print(
            f"TLS cluster: {len(before)} tasks before and {len(after)} after kill -9 of "
            f"{old_id}; {new.broker_id} leads; digest {digest[:16]}"
        )


# -- steward cluster up ----------------------------------------------------------------------


def test_cluster_up_passes_tls_on(tls: TlsFiles, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            *steward_command(),
            "cluster", "up", "--broker-count", "2", "--workers", "1",
            "--data-dir", str(tmp_path / "cluster"),
            "--tls-cert", str(tls.cert_path), "--tls-key", str(tls.key_path),
            "--tls-ca", str(tls.ca_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    watch = ClusterUpOutput(proc)
    try:
        output = watch.wait_up(CLUSTER_UP_TIMEOUT_S)
        urls = re.findall(
            r"^broker-\d+\s+(?:leader|follower)\s+\d+\s+(https://127\.0\.0\.1:\d+)$",
            output,
            re.MULTILINE,
        )
        assert len(urls) == 2, output
        assert f"--ca-file {tls.ca_path} status" in output, output
        with StewardClient(urls, ca_file=tls.ca_path) as client:
            task = client.submit("noop", tenant="up-tls").wait(TASK_TIMEOUT_S)
            assert task["state"] == "finished", task  # the worker found the leader over TLS
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=CLUSTER_UP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise
        watch.reader.join(timeout=5)
    assert code == 0, watch.text()
