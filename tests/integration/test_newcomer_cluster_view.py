"""Issue 17, friction 3: ``steward status`` on a cluster tells the truth, from any broker.

A real 3-broker cluster on a real ZooKeeper; one follower is killed with SIGKILL. The real
CLI, pointed at the other follower, marks it unreachable (with when it was last seen) and
shows every live broker's real log position, lag and uptime; the JSON says the same, and
keeps the dead broker once its ZooKeeper session has expired (docs/API.md "Cluster").
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import BrokerNode, ClusterProcesses
from tests.support.procs import steward_command
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CLI_TIMEOUT_S = 30.0
# The peer poll (1 s, bounded by 2 s) plus slack for a loaded machine.
MARK_LIMIT_S = 15.0


def _status(url: str) -> tuple[str, float]:
    """``steward --url URL status``: its stdout and how long it took; exit 0, no traceback."""
    started = time.monotonic()
    done = subprocess.run(
        [*steward_command(), "--url", url, "status"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout, took


def _rows(output: str) -> dict[str, dict[str, str]]:
    """The brokers table of ``steward status``, by broker id."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ID ") and "STATE" in line)
    names = lines[header].split()
    rows: dict[str, dict[str, str]] = {}
    for line in lines[header + 1 :]:
        if not line.strip() or line.startswith(" "):
            break  # the end of the table, or its notes
        cells = re.split(r"\s{2,}", line.strip(), maxsplit=len(names) - 1)
        rows[cells[0]] = dict(zip([n.lower() for n in names], cells, strict=True))
    return rows


def _cluster(node: BrokerNode) -> dict[str, Any]:
    response = httpx.get(node.url + "/api/v1/cluster", timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_status_marks_a_killed_follower_unreachable(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        leader = cluster.wait_for_leader(30)
        for n in range(5):  # positions past the first entries
            response = httpx.post(
                leader.url + "/api/v1/tasks",
                json={"type": "demo.job", "tenant": "view", "params": {"n": n}},
                timeout=10,
            )
            assert response.status_code == 201, response.text
        asked, victim = [node for node in cluster.live() if node is not leader]

        def all_reachable() -> bool:
            brokers = _cluster(asked)["brokers"]
            return len(brokers) == 3 and all(
                b["reachable"] and b["position"]["entry_id"] >= 0 for b in brokers
            )

        # Peers are polled every second: wait for a poll after the writes.
        wait_until(all_reachable, 30, "the asked follower to have polled every peer")

        def in_sync() -> bool:
            # Idle, the leader ends its log with a Confirm marker followers stop short
            # of: in sync is still a lag of 0.
            return all(b["lag_entries"] == 0 for b in _cluster(asked)["brokers"])

        wait_until(in_sync, 30, "every broker in sync, lag 0")
        # Before the kill: every broker with a real position, uptime and version.
        output, _ = _status(asked.url)
        rows = _rows(output)
        assert set(rows) == {leader.broker_id, asked.broker_id, victim.broker_id}, output
        for row in rows.values():
            assert re.fullmatch(r"\d+:\d+", row["position"]), output
            assert row["position"] != "-1:-1" and row["uptime"] != "unknown", output
            assert row["state"] == "ok" and row["version"] != "unknown", output
            assert re.fullmatch(r"\d+", row["lag"]), output
        assert rows[leader.broker_id]["role"] == "leader", output

        killed_at = cluster.kill9(victim.broker_id)

        def marked() -> tuple[str, float] | None:
            output, took = _status(asked.url)
            row = _rows(output).get(victim.broker_id)
            return (output, took) if row and row["state"].startswith("UNREACHABLE") else None

        output, took = wait_until(marked, MARK_LIMIT_S, "status to mark the killed broker")
        marked_after = time.monotonic() - killed_at
        print(f"\nmarked unreachable {marked_after:.1f} s after the kill; status took {took:.2f} s")
        print(output)
        rows = _rows(output)
        dead = rows[victim.broker_id]
        assert "last seen" in dead["state"], output
        assert f"(as seen by {asked.broker_id})" in output.splitlines()[0], output
        # The note under the table says why its values are unknown and what to do.
        assert re.search(rf"^  {victim.broker_id}: unreachable: .*last seen", output, re.M), output
        assert "check its process and its log" in output, output
        assert (dead["position"], dead["uptime"], dead["role"]) == (
            "unknown",
            "unknown",
            "unreachable",
        ), output
        for live in (leader, asked):
            row = rows[live.broker_id]
            assert row["state"] == "ok" and row["role"] in ("leader", "follower"), output
            assert re.fullmatch(r"\d+:\d+", row["position"]), output
            assert row["position"] != "-1:-1", output
            assert row["uptime"] != "unknown" and not row["uptime"].startswith("0.0"), output
        assert took < CLI_TIMEOUT_S

        # The JSON: real values for the live ones, null + reason for the dead one, which
        # stays in the view after its ZooKeeper session expired (it left the membership).
        def departed() -> dict[str, Any] | None:
            brokers = {b["id"]: b for b in _cluster(asked)["brokers"]}
            gone = brokers.get(victim.broker_id)
            return brokers if gone is not None and not gone["member"] else None

        brokers = wait_until(departed, 30, "the killed broker's session to expire")
        gone = brokers[victim.broker_id]
        assert gone["reachable"] is False and gone["position"] is None
        assert gone["uptime_secs"] is None and gone["lag_entries"] is None
        assert gone["last_seen_secs_ago"] > 0 and "left the membership" in gone["unknown_reason"]
        for live in (leader, asked):
            b = brokers[live.broker_id]
            assert b["reachable"] is True and b["uptime_secs"] > 0, b
            assert b["position"]["entry_id"] >= 0 and b["lag_entries"] is not None, b
            assert b["unknown_reason"] is None, b
        assert brokers[leader.broker_id]["lag_entries"] == 0
        output, _ = _status(asked.url)
        assert "left the cluster" in _rows(output)[victim.broker_id]["state"], output
