"""Issue 17, frictions 1 and 8, as a newcomer meets them: ``steward worker`` pointed at
a real ``steward standalone`` by its one HTTP URL, or at the wrong thing, and a second
broker started on taken ports.

Every process is real (the ``steward`` command); each misconfigured worker must exit
non-zero within 30 s with one line naming what it tried and what to pass instead, and no
traceback; a worker waiting for something that may come keeps running and says what it
waits for, without a line per retry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses, ClusterWorker
from tests.support.procs import (
    HOST,
    AuthenticatedBroker,
    authenticated_broker,
    free_port,
    steward_command,
)
from tests.support.worker_procs import wait_until

MISCONFIGURED_EXIT_S = 30.0  # the bound for a misconfigured worker
ADMIN_TOKEN = "newcomer-admin-token"
WORKER_TOKEN = "newcomer-worker-token"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthenticatedBroker]:
    root = tmp_path_factory.mktemp("newcomer-connect")
    with authenticated_broker(root, admin_token=ADMIN_TOKEN, worker_token=WORKER_TOKEN) as b:
        yield b


def _env() -> dict[str, str]:
    drop = {"STEWARD_URL", "STEWARD_BROKER", "STEWARD_WORKER_TOKEN", "STEWARD_WORKER_TOKEN_FILE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _worker(tmp_path: Path, name: str, *args: str) -> subprocess.Popen[str]:
    """``steward worker`` with ``args``; no Spark and tasks in threads (quick to start)."""
    return subprocess.Popen(
        [
            *steward_command(),
            "worker",
            *args,
            "--worker-id",
            name,
            "--cache-dir",
            str(tmp_path / name),
            "--spark",
            "off",
            "--task-isolation",
            "thread",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _wrong_token(tmp_path: Path) -> str:
    path = tmp_path / "wrong-token"
    path.write_text("not-the-worker-token\n")
    path.chmod(0o600)
    return str(path)


def test_a_worker_given_the_brokers_url_finds_the_worker_endpoint(
    broker: AuthenticatedBroker, tmp_path: Path
) -> None:
    worker = _worker(
        tmp_path,
        "by-url",
        "--broker",
        broker.broker.url,
        "--token-file",
        str(broker.worker_token_file),
    )
    try:
        summary = broker.http.get("/api/v1/cluster").json()
        assert summary["leader_worker_address"] == f"{HOST}:{broker.worker_port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert worker.poll() is None, worker.communicate()
            workers = broker.http.get("/api/v1/cluster").json()["workers"]
            if any(w["id"] == "by-url" and w["state"] == "connected" for w in workers):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the worker given the broker's URL did not connect within 30 s")
        submitted = broker.http.post("/api/v1/tasks", json={"type": "noop"})
        assert submitted.status_code in (200, 201), submitted.text
        task_id = submitted.json()["id"]
        done = broker.http.get(f"/api/v1/tasks/{task_id}", params={"wait_s": "20"}).json()
        assert done["state"] == "finished" and done["worker"] == "by-url", done
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert f"connected to broker {HOST}:{broker.worker_port}" in stderr


def test_misconfigured_workers_exit_with_one_line_saying_what_to_pass(
    broker: AuthenticatedBroker, tmp_path: Path
) -> None:
    http_host_port = broker.broker.url.removeprefix("http://")
    token = ("--token-file", str(broker.worker_token_file))
    cases = {
        # The HTTP port where the worker port was expected: no frame-size spam.
        "http-port": (
            ("--broker", http_host_port, *token),
            ("answered in HTTP", f"--broker http://{http_host_port}"),
        ),
        # The worker port given as an HTTP URL.
        "worker-port": (
            ("--broker", f"http://{HOST}:{broker.worker_port}", *token),
            ("does not answer HTTP", "worker port", "HOST:PORT without http://"),
        ),
        # A wrong token, through the URL and straight at the worker endpoint.
        "token-url": (
            ("--broker", broker.broker.url, "--token-file", _wrong_token(tmp_path)),
            ("refused the worker's token", "--token-file"),
        ),
        "token-endpoint": (
            ("--broker", f"{HOST}:{broker.worker_port}", "--token-file", _wrong_token(tmp_path)),
            ("refused the worker's token", "--token-file"),
        ),
    }
    started = time.monotonic()
    workers = {name: _worker(tmp_path, name, *args) for name, (args, _) in cases.items()}
    try:
        for name, (_, words) in cases.items():
            left = max(0.1, started + MISCONFIGURED_EXIT_S - time.monotonic())
            _, stderr = workers[name].communicate(timeout=left)
            assert workers[name].returncode == 2, (name, stderr)
            assert "Traceback" not in stderr, (name, stderr)
            last = stderr.strip().splitlines()[-1]
            assert last.startswith("steward worker: error: "), (name, stderr)
            for word in words:
                assert word in last, (name, word, last)
            # One line per problem, then one now and then: not one per retry.
            assert stderr.count("WARNING") <= 3, (name, stderr)
            assert "frame of" not in stderr, (name, stderr)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert time.monotonic() - started < MISCONFIGURED_EXIT_S


def test_a_url_without_scheme_is_a_usage_error_naming_the_fix(tmp_path: Path) -> None:
    worker = _worker(tmp_path, "no-scheme", "--brokers", f"{HOST}:8080")
    _, stderr = worker.communicate(timeout=MISCONFIGURED_EXIT_S)
    assert worker.returncode == 2
    assert f"write http://{HOST}:8080" in stderr and "Traceback" not in stderr


def test_a_worker_waiting_for_a_broker_says_what_it_waits_for(tmp_path: Path) -> None:
    nothing = f"http://{HOST}:{free_port()}"  # no broker (yet): that may heal
    worker = _worker(tmp_path, "waiting", "--broker", nothing)
    assert worker.stderr is not None
    err = worker.stderr
    lines: list[str] = []
    said = threading.Event()

    def read() -> None:  # until EOF, so the pipe never fills
        for line in err:
            lines.append(line)
            if "waiting for a leader's worker endpoint" in line:
                said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # It says what it waits for, and is still waiting (not exiting) after saying so.
        assert said.wait(30), "".join(lines)
        assert worker.poll() is None, "".join(lines)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        reader.join(timeout=30)
    stderr = "".join(lines)
    assert worker.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "waiting for a leader's worker endpoint" in stderr
    assert f"{nothing}: connection refused (is the broker running?)" in stderr
    assert stderr.count("WARNING") <= 2, stderr  # not a line per retry


def _standalone(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*steward_command(), "standalone", "--data-dir", str(tmp_path / "second"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_a_taken_port_names_the_flag_that_moves_it(
    broker: AuthenticatedBroker, tmp_path: Path
) -> None:
    http_host_port = broker.broker.url.removeprefix("http://")
    for args, words in (
        (
            ("--http", http_host_port, "--worker-listen", f"{HOST}:{free_port()}"),
            ("could not serve HTTP on", "address already in use", "--http HOST:PORT"),
        ),
        (
            ("--http", f"{HOST}:{free_port()}", "--worker-listen", f"{HOST}:{broker.worker_port}"),
            ("cannot listen for workers on", "address already in use", "--worker-listen HOST:PORT"),
        ),
        (("--http", f"http://{http_host_port}"), ("got a URL: write", http_host_port)),
    ):
        started = time.monotonic()
        result = _standalone(tmp_path, *args)
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr + result.stdout
        last = result.stderr.strip().splitlines()[-1]
        for word in words:
            assert word in last, (word, result.stderr)
        assert time.monotonic() - started < 20
    # The first broker is untouched.
    assert httpx.get(f"{broker.broker.url}/healthz", timeout=5).status_code == 200


def test_one_followers_url_follows_the_leader_of_a_cluster(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    """``--broker URL`` of one follower: the worker connects to the leader, and after the
    leader dies, to the next one (the follower it asks stays up)."""
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        old = cluster.wait_for_leader(30)
        follower = next(node for node in cluster.live() if node is not old)
        worker = ClusterWorker(
            "one-url",
            ["--broker", follower.url],
            log_path=tmp_path / "one-url.log",
            cache_dir=tmp_path / "one-url-cache",
            extra_args=("--task-isolation", "thread"),
        )
        cluster.workers.append(worker)
        worker.start()
        assert cluster.wait_workers_connected(["one-url"], 30) is old
        old.kill9()
        new = cluster.wait_for_leader(60, excluding=[old.broker_id])
        # The new leader's state lists the worker as connected until it times out (it
        # was replicated so): the worker's own log says when it reached the new leader.
        reached = f"connected to broker {new.worker_address}"
        wait_until(lambda: reached in worker.log_text(), 60, "the worker on the new leader")
        log = worker.log_text()
        assert f"the leader's worker endpoint is {new.worker_address}" in log, log
        assert "Traceback" not in log
