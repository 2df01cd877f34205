"""``steward cluster up``: ZooKeeper, 3 brokers and a worker on this machine (their ledgers in
files, on pulsar-lite, or on an Apache Pulsar standalone from the engines cache); a task runs
through it; SIGTERM stops every process it started, cleanly. Without the cached Pulsar jars,
``--ledgers pulsar`` stops at once with one line saying what to do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from clients.client import StewardClient
from clients.dev.engine_jvm import FIRST_START_TIMEOUT_S
from clients.dev.pulsar_standalone import pulsar_version
from tests.support.cluster_up import ClusterUpOutput, descendants
from tests.support.procs import steward_command

START_TIMEOUT_S = 120.0
# Apache Pulsar's JVM first (bounded by FIRST_START_TIMEOUT_S in clients/dev/engine_jvm.py).
APACHE_PULSAR_START_TIMEOUT_S = FIRST_START_TIMEOUT_S + START_TIMEOUT_S
STOP_TIMEOUT_S = 90.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; its parent reaps it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(FIRST_START_TIMEOUT_S + 300)
@pytest.mark.parametrize(
    ("ledgers", "auth"),
    [("file", False), ("pulsar-lite", False), ("apache-pulsar", False), ("file", True)],
)
def test_cluster_up_runs_a_task_and_stops_cleanly(tmp_path: Path, ledgers: str, auth: bool) -> None:
    ledger_args = {
        "file": ["--ledgers", "file"],
        "pulsar-lite": ["--ledgers", "pulsar", "--pulsar-flavor", "pulsar-lite"],
        "apache-pulsar": ["--ledgers", "pulsar"],  # the default flavor
    }[ledgers]
    admin_token = "cluster-up-admin-token"
    auth_args: list[str] = []
    if auth:
        (tmp_path / "admin-token").write_text(admin_token + "\n")
        auth_args = ["--admin-token-file", str(tmp_path / "admin-token")]
    proc = subprocess.Popen(
        [
            *steward_command(),
            "cluster",
            "up",
            "--broker-count",
            "3",
            "--workers",
            "1",
            *ledger_args,
            "--data-dir",
            str(tmp_path / "cluster"),
            *auth_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watch = ClusterUpOutput(proc)
    children: set[int] = set()
    try:
        output = watch.wait_up(
            APACHE_PULSAR_START_TIMEOUT_S if ledgers == "apache-pulsar" else START_TIMEOUT_S
        )
        # Each process with its role and pid, and the leader's pid in a kill command.
        brokers = re.findall(
            r"^(broker-\d+)\s+(leader|follower)\s+(\d+)\s+(http://127\.0\.0\.1:\d+)$",
            output,
            re.MULTILINE,
        )
        assert len(brokers) == 3, output
        assert [role for _, role, _, _ in brokers].count("leader") == 1, output
        urls = [url for _, _, _, url in brokers]
        leader_pid = next(int(pid) for _, role, pid, _ in brokers if role == "leader")
        assert re.search(rf"^failover\s+kill -9 {leader_pid}\b", output, re.MULTILINE), output
        assert re.search(r"^zookeeper\s+zookeeper\s+\d+\s+127\.0\.0\.1:\d+$", output, re.M), output
        assert re.search(r"^worker-1\s+worker\s+\d+\s", output, re.MULTILINE), output
        children = descendants(proc.pid)
        # ZooKeeper, 3 brokers, 1 worker (and the Pulsar server)
        assert len(children) >= (5 if ledgers == "file" else 6), children
        if ledgers == "pulsar-lite":
            assert re.search(
                r"^pulsar-lite\s+ledgers\s+\d+\s+pulsar://127\.0\.0\.1:\d+$", output, re.M
            )
        if ledgers == "apache-pulsar":
            assert f"starting Apache Pulsar {pulsar_version()}" in output, output
            assert re.search(r"^pulsar\s+ledgers\s+\d+\s+pulsar://127\.0\.0\.1:\d+$", output, re.M)
            admin = re.search(r"^pulsar\s+admin\s+\d+\s+(http://127\.0\.0\.1:\d+)$", output, re.M)
            assert admin, output
        if auth:
            # Brokers and the worker got their tokens: a task runs; nobody else gets in.
            assert "--token" in output, output
            assert httpx.get(urls[0] + "/api/v1/tasks", timeout=10).status_code == 401
        with StewardClient(urls, token=admin_token if auth else None) as client:
            handle = client.submit("sleep", params={"seconds": 0.1}, tenant="up")
            task = handle.wait(timeout=60)
            assert task["state"] == "finished", task
            summary = client.cluster()
            assert summary["leader"] is not None
            assert len(summary["brokers"]) == 3
        if ledgers == "apache-pulsar":
            # The log is on the standalone: the cluster's ledger topics in public/steward.
            assert admin is not None
            topics = httpx.get(f"{admin[1]}/admin/v2/persistent/public/steward", timeout=10)
            assert topics.status_code == 200, topics.text
            assert any("/local-ledger-" in topic for topic in topics.json()), topics.text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            for pid in children:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise
        watch.reader.join(timeout=5)
    print("".join(watch.lines[-6:]))
    assert code == 0, watch.text()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    leftovers = [pid for pid in children if _alive(pid)]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes left behind: {leftovers}"


def test_cluster_up_on_pulsar_without_the_jars_says_how_to_fetch_them(tmp_path: Path) -> None:
    empty = tmp_path / "engines"
    empty.mkdir()
    run = subprocess.run(
        [
            *steward_command(),
            "cluster",
            "up",
            "--ledgers",
            "pulsar",
            "--data-dir",
            str(tmp_path / "cluster"),
        ],
        env={**os.environ, "STEWARD_ENGINES_DIR": str(empty)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("steward: cluster up failed: no Apache Pulsar"), lines
    for hint in ("./scripts/fetch-engines", "STEWARD_ENGINES_DIR", str(empty), "pulsar-lite"):
        assert hint in lines[0], lines
    # Nothing was started: not even ZooKeeper.
    assert not (tmp_path / "cluster" / "zookeeper").exists()
