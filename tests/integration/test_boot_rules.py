"""Boot and upgrade rules on real ``steward broker`` processes (issue 18 item 7;
docs/OPERATIONS.md, "Boot rules" and "Rolling upgrade"):

- a negative ``--max-replication-wait-ms`` other than -1 is refused at start in one line;
  -1 waits for the replicas however long it takes (the take-over with it must not crash);
- a broker that must load a snapshot and finds no source within ``--snapshot-source-wait-s``
  exits non-zero naming the peers it asked and its snapshots directory;
- a snapshot of a newer release stops the broker at start, naming the version;
- in a mixed-version cluster (a leader of the next release, tests/support/newer_release.py)
  today's follower follows until the first entry in the newer format, then exits naming it.

Every wait is bounded; processes are killed by pid when a test ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from broker.core import entries as e
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.format_samples import bump_file_version
from tests.support.procs import steward_command
from tests.support.worker_procs import wait_until

EXIT_TIMEOUT_S = 40.0


def test_a_negative_replication_wait_is_refused_at_start(tmp_path: Path) -> None:
    command = [
        *steward_command(),
        "broker",
        "--zookeeper",
        "127.0.0.1:1",  # never reached: the flags are checked first
        "--broker-id",
        "b0",
        "--data-dir",
        str(tmp_path / "data"),
        "--ledger-dir",
        str(tmp_path / "ledgers"),
        "--max-replication-wait-ms",
        "-5",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--max-replication-wait-ms must be >= 0, or -1 to wait forever" in lines[0]
    assert "Traceback" not in done.stderr


def _artifact(url: str, sha256: str) -> dict[str, object]:
    response = httpx.get(f"{url}/api/v1/code", timeout=5)
    response.raise_for_status()
    body = response.json()
    items = body["artifacts"]
    found: dict[str, object] = next(a for a in items if a["sha256"] == sha256)
    return found


def test_minus_one_waits_for_the_replicas_however_long(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    extra = ("--min-replication", "2", "--max-replication-wait-ms", "-1")
    with ClusterProcesses(zookeeper.connect_string, tmp_path, brokers=1, extra_args=extra) as c:
        leader = c.wait_for_leader()  # the take-over starts the monitor with -1
        response = httpx.post(
            f"{leader.url}/api/v1/code", params={"name": "job.py"}, content=b"x = 1\n", timeout=10
        )
        assert response.status_code == 201, response.text
        sha256 = response.json()["sha256"]
        time.sleep(1.5)  # with 0 ms it would be ready at once; -1 never gives up alone
        assert _artifact(leader.url, sha256)["ready"] is False
        c.add_broker()  # the second copy
        wait_until(
            lambda: _artifact(leader.url, sha256)["ready"] is True, 30.0, "ready with 2 copies"
        )


def _drop_snapshots(data_dir: Path) -> None:
    shutil.rmtree(data_dir / "snapshots", ignore_errors=True)


def _delete_history_start(zookeeper: str, cluster: str) -> None:
    """Make the ledger list say that retention deleted the history's first ledgers."""
    client = KazooClient(hosts=zookeeper)
    client.start(timeout=15)
    try:
        path = f"/steward/{cluster}/ledgers"
        data, stat = client.get(path)
        document = json.loads(data)
        ledgers = document.get("ledger_list", document)
        first = min(int(info["ledger_id"]) for info in ledgers["ledgers"])
        ledgers["first_ledger_id"] = first - 1
        client.set(path, json.dumps(document).encode(), version=stat.version)
    finally:
        client.stop()
        client.close()


def test_no_snapshot_source_exits_naming_what_it_tried(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    extra = ("--snapshot-source-wait-s", "3")
    with ClusterProcesses(zookeeper.connect_string, tmp_path, brokers=2, extra_args=extra) as c:
        c.wait_for_leader()
        for broker_id in ("b0", "b1"):
            assert c.stop(broker_id) == 0
        _delete_history_start(zookeeper.connect_string, c.name)
        for node in c.nodes.values():
            _drop_snapshots(node.data_dir)  # neither has a snapshot, nor can replay
            node.spawn()
        started = time.monotonic()
        codes = {node.broker_id: node.wait_exit(EXIT_TIMEOUT_S) for node in c.nodes.values()}
        elapsed_s = time.monotonic() - started
        print(f"\nboth exited after {elapsed_s:.1f} s (wait 3 s): {codes}")
        assert all(code != 0 for code in codes.values()), codes
        for node in c.nodes.values():
            other = next(n for n in c.nodes.values() if n is not node)
            text = node.log_text()
            line = next(x for x in text.splitlines() if x.startswith("steward: cannot start:"))
            print(line)
            assert "No snapshot source for 3 s (--snapshot-source-wait-s)" in line
            assert f"peers asked: {other.url}" in line  # (the other was up for a while)
            assert str(node.data_dir / "snapshots") in line
            assert "deleted by retention" in line
            assert "Traceback" not in text


def test_a_snapshot_of_a_newer_release_stops_the_broker(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path, brokers=1) as c:
        leader = c.wait_for_leader()
        response = httpx.post(f"{leader.url}/api/v1/tasks", json={"type": "noop"}, timeout=10)
        assert response.status_code == 201, response.text
        assert c.stop(leader.broker_id) == 0  # a clean stop takes a snapshot
        snapshots = sorted((leader.data_dir / "snapshots").glob("snapshot-*.snap"))
        assert snapshots, "no snapshot at the clean stop"
        bump_file_version(snapshots[-1])
        leader.spawn()
        assert leader.wait_exit(EXIT_TIMEOUT_S) != 0
        text = leader.log_text()
        line = next(x for x in text.splitlines() if x.startswith("steward: cannot start:"))
        assert snapshots[-1].name in line
        assert "format version 2 is newer than this broker's 1" in line
        assert "upgrade the broker" in line
        assert "Traceback" not in text
        assert snapshots[-1].exists()  # kept for the newer release


def test_the_broker_config_refuses_the_same_values(tmp_path: Path) -> None:
    from broker.replication.node import NodeConfig
    from broker.server.cluster import BrokerConfig

    node = NodeConfig(data_dir=tmp_path)
    for wait_ms in (-2, -60_000):
        with pytest.raises(ValueError, match="or -1 to wait forever"):
            BrokerConfig(node, "zk:1", ledger_dir=tmp_path, max_replication_wait_ms=wait_ms)
    with pytest.raises(ValueError, match="snapshot_source_wait_s must be positive"):
        BrokerConfig(node, "zk:1", ledger_dir=tmp_path, snapshot_source_wait_s=0)
    assert BrokerConfig(node, "zk:1", ledger_dir=tmp_path, max_replication_wait_ms=-1)


def test_an_old_follower_of_a_newer_leader_stops_at_its_first_newer_entry(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root)}
    with ClusterProcesses(zookeeper.connect_string, tmp_path, brokers=0, extra_env=env) as c:
        newer = c.add_broker(wait=False)
        today = newer.command

        def newer_command() -> list[str]:
            command = today()
            return [
                sys.executable,
                "-m",
                "tests.support.newer_release",
                *command[command.index("broker") :],
            ]

        newer.command = newer_command  # type: ignore[method-assign]
        c.start(newer.broker_id)
        assert c.wait_for_leader() is newer
        old = c.add_broker()  # today's release: follows what the newer one writes so far
        wait_until(lambda: (old.own_summary() or {}).get("role") == "follower", 30.0, "old follows")
        assert old.running()
        response = httpx.post(f"{newer.url}/api/v1/tasks", json={"type": "noop"}, timeout=10)
        assert response.status_code == 201, response.text  # written in the newer format
        assert old.wait_exit(EXIT_TIMEOUT_S) != 0
        text = old.log_text()
        line = next(x for x in text.splitlines() if x.startswith("steward: cannot start:"))
        print(line)
        newer_v, ours_v = e.ENTRY_FORMAT_VERSION + 1, e.ENTRY_FORMAT_VERSION
        assert f"log entry format version {newer_v} is newer than this broker's {ours_v}" in line
        assert f"upgrade the broker to a release that reads version {newer_v}" in line
        assert "written by a leader of a newer release" in line
        assert "Traceback" not in text
        assert c.leader() is newer  # the newer leader goes on
