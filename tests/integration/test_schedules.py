"""Issue 18 acceptance, periodic tasks: a 3-broker cluster on a real ZooKeeper, schedules
with a 1 s interval, the leader killed (-9) twice across ticks; every tick runs exactly
once (run_all), or is run once or counted as skipped (run_once), and the tasks are there.
And a standalone broker with a worker: the scheduled tasks run, also after kill -9.

Real ``steward broker`` / ``steward standalone`` processes; the cluster's schedules are
created with the ``steward schedule`` CLI and read over HTTP. In the cluster no worker
runs: a tick's run is the task it creates (what the schedule guarantees). Every wait is
bounded.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import BrokerNode, ClusterProcesses
from tests.support.procs import BrokerProcess, steward_output
from tests.support.worker_procs import wait_until
from tests.support.write_load import fetch_tasks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TENANT = "periodic"


def _ms(iso: str) -> int:
    return round(datetime.fromisoformat(iso).timestamp() * 1000)


def _schedule(node: BrokerNode, name: str) -> dict[str, Any]:
    return _schedule_at(node.url, name)


def _cli(urls: list[str], *args: str) -> str:
    return steward_output(",".join(urls), *args)


def _handled(schedule: dict[str, Any]) -> int:
    """Ticks handled so far: the first tick is one interval after creation."""
    first = _ms(schedule["created"]) + 1_000
    return (_ms(schedule["next_tick"]) - first) // 1_000


def _wait_ticks(cluster: ClusterProcesses, name: str, more: int) -> BrokerNode:
    leader = cluster.wait_for_leader(40)
    target = _handled(_schedule(leader, name)) + more
    wait_until(
        lambda: _handled(_schedule(leader, name)) >= target, 20, f"{more} more ticks of {name}"
    )
    return leader


def test_each_tick_runs_once_across_leader_kills(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        cluster.wait_for_leader(30)
        for name, missed in (("every", "run_all"), ("once", "run_once")):
            out = _cli(
                cluster.urls(),
                "schedule", "create", name, "--tenant", TENANT, "--type", "noop",
                "--params", f'{{"from": "{name}"}}', "--interval-s", "1", "--missed", missed,
            )  # fmt: skip
            assert out.startswith(f"schedule {name} of {TENANT}: next "), out
        out = _cli(
            cluster.urls(),
            "schedule", "create", "spare", "--tenant", TENANT, "--type", "noop",
            "--cron", "0 3 * * *",
        )  # fmt: skip
        assert "spare" in out
        leader = _wait_ticks(cluster, "every", 2)
        killed = []
        for _ in range(2):
            # kill -9 the leader between ticks; the next one carries on from the log.
            cluster.kill9(leader.broker_id)
            killed.append(leader.broker_id)
            leader = _wait_ticks(cluster, "every", 2)
            if len(killed) == 1:
                cluster.start(killed[0])  # back as a follower: two brokers remain
        views = {name: _schedule(leader, name) for name in ("every", "once")}
        tasks = fetch_tasks(leader, tenant=TENANT)
        _check_run_all(views["every"], tasks)
        _check_run_once(views["once"], tasks)
        listed = _cli(cluster.urls(), "schedule", "list", "--tenant", TENANT)
        assert all(name in listed for name in ("every", "once", "spare")), listed
        out = _cli(cluster.urls(), "schedule", "delete", "spare", "--tenant", TENANT)
        assert out == f"schedule spare of {TENANT} deleted\n", out
        for name in ("every", "once"):
            response = httpx.delete(
                f"{leader.url}/api/v1/schedules/{name}", params={"tenant": TENANT}, timeout=10
            )
            assert response.status_code == 200, response.text
        cluster.wait_for_equal_digests(30)
        for node in cluster.live():
            gone = node.get_json(f"/api/v1/schedules?tenant={TENANT}")
            assert gone == {"schedules": []}, (node, gone)
        print(
            f"killed leaders {killed}; every: {views['every']['runs']} runs; once: "
            f"{views['once']['runs']} runs, {views['once']['skipped']} ticks skipped"
        )


def test_scheduled_tasks_run_on_a_worker_and_survive_kill9(tmp_path: Path) -> None:
    """A standalone broker with a worker: the ticks' tasks run and finish; after kill -9
    and a restart the schedule goes on from its replicated next tick (run_all: the ticks
    missed while it was down run too, each once)."""
    with BrokerProcess(
        tmp_path / "data", log_path=tmp_path / "broker.log", extra_args=("--workers", "1")
    ) as broker:
        broker.start()
        body = {
            "name": "beat",
            "tenant": TENANT,
            "task": {"type": "sleep", "params": {"seconds": 0}},
            "interval_s": 1,
            "missed": "run_all",
        }
        response = httpx.post(broker.url + "/api/v1/schedules", json=body, timeout=10)
        assert response.status_code == 201, response.text

        def finished() -> int:
            listed = httpx.get(
                broker.url + "/api/v1/tasks",
                params={"tenant": TENANT, "state": "finished", "limit": 1000},
                timeout=10,
            )
            return len(listed.json()["tasks"])

        wait_until(lambda: finished() >= 2, 45, "two scheduled tasks finished on the worker")
        broker.kill9()
        broker.start()
        view = _schedule_at(broker.url, "beat")
        before = _handled(view)
        wait_until(lambda: _handled(_schedule_at(broker.url, "beat")) >= before + 2, 20, "ticks")
        view = _schedule_at(broker.url, "beat")
        ticks = [_ms(f["tick"]) for f in view["recent"]]
        assert view["skipped"] == 0 and view["runs"] == _handled(view), view
        assert ticks == list(range(ticks[0], ticks[0] + 1_000 * len(ticks), 1_000)), ticks
        wait_until(lambda: finished() >= 4, 45, "scheduled tasks finished after the restart")


def _schedule_at(url: str, name: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/api/v1/schedules/{name}", params={"tenant": TENANT}, timeout=10)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _created_by(
    view: dict[str, Any], tasks: dict[int, dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """The ticks of the view's recent firings, and the ids of every task the schedule had
    created by then (ids only grow: none after its last firing's)."""
    ticks = [_ms(f["tick"]) for f in view["recent"]]
    last = max(f["task_id"] for f in view["recent"])
    mine = sorted(
        i for i, t in tasks.items() if t["params"] == {"from": view["name"]} and i <= last
    )
    return ticks, mine


def _check_run_all(view: dict[str, Any], tasks: dict[int, dict[str, Any]]) -> None:
    handled = _handled(view)
    ticks, mine = _created_by(view, tasks)
    # Exactly one run per tick: as many tasks as ticks handled, none skipped.
    assert view["skipped"] == 0 and view["runs"] == handled == len(mine), (view, mine)
    assert ticks == list(range(ticks[0], ticks[0] + 1_000 * len(ticks), 1_000)), ticks
    assert len({f["task_id"] for f in view["recent"]}) == len(ticks)


def _check_run_once(view: dict[str, Any], tasks: dict[int, dict[str, Any]]) -> None:
    ticks, mine = _created_by(view, tasks)
    # Every tick handled once: run, or skipped (collapsed into a later run) after an outage
    # (the failover takes about the ZooKeeper session timeout, 4 s: several ticks).
    assert view["runs"] + view["skipped"] == _handled(view), view
    assert view["runs"] == len(mine) and view["skipped"] > 0, (view, mine)
    assert ticks == sorted(set(ticks)), ticks
