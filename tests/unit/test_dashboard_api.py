"""The dashboard's side of the HTTP API in process: its files at ``/`` and ``/dashboard/``,
and the read-only views it polls (broker statuses with lag, recent throughput, recent tasks).

A fresh Node on memory ledgers behind ``httpx.ASGITransport``; the broker-status test's
peers are a real PeerTable's rows (the cluster view's). No answer may be a 5xx.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.api import api_models as m
from broker.api.http_api import ApiApp, ApiConfig, ClusterView
from broker.core import Applied, TaskRef
from broker.core import entries as e
from broker.observability.dashboard import ThroughputRecorder
from broker.replication.node import Node, Stamp
from broker.server.peer_view import PeerTable
from tests.support.memory_node import memory_node

CONFIG = ApiConfig(max_list_limit=50)


async def _client(
    tmp_path: Path, cluster: ClusterView | None = None
) -> AsyncIterator[tuple[Node, httpx.AsyncClient]]:
    node = memory_node(tmp_path)
    await node.start()
    statuses: list[int] = []

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    transport = httpx.ASGITransport(app=ApiApp(node, CONFIG, cluster=cluster))  # type: ignore[arg-type]
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", event_hooks={"response": [record]}
        ) as client:
            yield node, client
    finally:
        await node.stop(snapshot=False)
        await node.ledgers.close()
    assert all(status < 500 for status in statuses), statuses


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[Node, httpx.AsyncClient]]:
    async for pair in _client(tmp_path):
        yield pair


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"]["code"] == code, body
    message: str = body["error"]["message"]
    return message


async def _submit(client: httpx.AsyncClient, **task: Any) -> int:
    response = await client.post("/api/v1/tasks", json={"type": "noop", **task})
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


async def _run(node: Node, task_id: int, *, ok: bool) -> None:
    """Assign the task to worker "w" and log its finish (ok) or failure."""
    if "w" not in node.state.workers:
        await node.propose(
            lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 10})
        )
    await node.propose(
        lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=(e.Assignment(task_id, "w"),))
    )

    def finish(stamp: Stamp) -> e.Entry:
        outcome = e.TaskOutcome(
            task_id=task_id,
            worker_id="w",
            attempt=1,
            ok=ok,
            result=b'{"answer": 42}' if ok else None,
            error=None if ok else "RuntimeError: boom\nTraceback (most recent call last): ...",
        )
        return e.FinishTasks(time_ms=stamp.now_ms, outcomes=(outcome,))

    await node.propose(finish)


# --- the page ---------------------------------------------------------------------------------


async def test_the_page_and_every_file_it_loads_are_served(
    api: tuple[Node, httpx.AsyncClient],
) -> None:
    _, client = api
    page = await client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<title>Steward dashboard</title>" in page.text
    # Nothing from elsewhere (no CDN: there is no internet at run time).
    assert not re.search(r'(src|href)="(https?:)?//', page.text)
    loaded = set(re.findall(r'(?:src|href)="(/dashboard/[^"]+)"', page.text))
    assert loaded == {"/dashboard/app.js", "/dashboard/style.css", "/dashboard/icon.svg"}
    types = {
        "/dashboard/app.js": "text/javascript; charset=utf-8",
        "/dashboard/style.css": "text/css; charset=utf-8",
        "/dashboard/icon.svg": "image/svg+xml",
    }
    for path, content_type in types.items():
        response = await client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"] == content_type
        assert int(response.headers["content-length"]) == len(response.content) > 100
    # Every API path the script reads exists (a typo would only show in a browser).
    script = (await client.get("/dashboard/app.js")).text
    for path in set(re.findall(r'"(/api/v1/[a-z/]+)', script)):
        response = await client.get(path.rstrip("/") + ("/1" if path.endswith("/") else ""))
        assert response.status_code in (200, 404), (path, response.text)
        if response.status_code == 404:
            assert "no such endpoint" not in response.text, path


async def test_only_the_dashboard_files_are_served(api: tuple[Node, httpx.AsyncClient]) -> None:
    _, client = api
    for path in (
        "/dashboard/nothing.js",
        "/dashboard/__init__.py",
        "/dashboard/",
        "/dashboard/%2e%2e%2fhttp_api.py",
        "/index.html",
    ):
        assert (await client.get(path)).status_code == 404, path
    assert "dashboard file" in _error(await client.get("/dashboard/x.css"), 404, "not_found")
    _error(await client.post("/", content=b"x"), 405, "method_not_allowed")
    _error(await client.put("/dashboard/app.js", content=b"x"), 405, "method_not_allowed")


# --- recent tasks -------------------------------------------------------------------------


async def test_recent_tasks_newest_first_with_filters_and_pages(
    api: tuple[Node, httpx.AsyncClient],
) -> None:
    node, client = api
    ids = [
        await _submit(client, tenant="a"),
        await _submit(client, tenant="b", type="sleep"),
        await _submit(client, tenant="a", type="sleep"),
        await _submit(client, tenant="b"),
        await _submit(client, tenant="a"),
    ]
    await _run(node, ids[0], ok=False)

    async def recent(**query: Any) -> tuple[list[int], int | None]:
        response = await client.get("/api/v1/tasks/recent", params=query)
        assert response.status_code == 200, response.text
        body = response.json()
        return [t["id"] for t in body["tasks"]], body["next_before"]

    assert await recent() == (ids[::-1], None)
    assert await recent(limit=2) == ([ids[4], ids[3]], ids[3])
    assert await recent(limit=2, before=ids[3]) == ([ids[2], ids[1]], ids[1])
    assert await recent(limit=2, before=ids[1]) == ([ids[0]], None)
    assert await recent(tenant="a") == ([ids[4], ids[2], ids[0]], None)
    assert await recent(type="sleep", tenant="b") == ([ids[1]], None)
    assert await recent(state="error") == ([ids[0]], None)
    assert await recent(tenant="nobody") == ([], None)
    body = (await client.get("/api/v1/tasks/recent", params={"state": "error"})).json()
    assert body["tasks"][0]["error"].startswith("RuntimeError: boom")

    for query, words in (
        ({"state": "bogus"}, "state must be one of"),
        ({"limit": "0"}, "limit must be"),
        ({"limit": "51"}, "limit must be"),
        ({"before": "0"}, "before must be"),
        ({"before": "x"}, "before must be"),
        ({"after": "1"}, "unknown query parameters"),
    ):
        message = _error(
            await client.get("/api/v1/tasks/recent", params=query), 400, "invalid_request"
        )
        assert words in message, (query, message)


# --- throughput -----------------------------------------------------------------------------


async def test_throughput_counts_submissions_finishes_failures_and_cancels(
    api: tuple[Node, httpx.AsyncClient],
) -> None:
    node, client = api
    empty = (await client.get("/api/v1/stats/throughput")).json()
    assert empty["bucket_s"] == 5
    assert len(empty["submitted"]) == len(empty["finished"]) == 60
    assert sum(empty["submitted"]) == sum(empty["finished"]) == 0
    assert empty["max_task_id"] == 0

    batch = await client.post(
        "/api/v1/tasks",
        json={"tasks": [{"type": "noop"}] * 3},
        headers={"Idempotency-Key": "dash-1"},
    )
    assert batch.status_code == 200, batch.text
    # A replay (same key) creates nothing: not counted.
    replay = await client.post(
        "/api/v1/tasks",
        json={"tasks": [{"type": "noop"}] * 3},
        headers={"Idempotency-Key": "dash-1"},
    )
    assert replay.json()["replayed"] is True
    first, second, third = (t["id"] for t in batch.json()["tasks"])
    await _run(node, first, ok=True)
    await _run(node, second, ok=False)
    assert (await client.post(f"/api/v1/tasks/{third}/cancel")).status_code == 200

    body = (await client.get("/api/v1/stats/throughput")).json()
    totals = {kind: sum(body[kind]) for kind in ("submitted", "finished", "failed", "cancelled")}
    assert totals == {"submitted": 3, "finished": 1, "failed": 1, "cancelled": 1}
    # All of it just now: in the newest bucket or the one before (a bucket edge).
    assert sum(body["submitted"][-2:]) == 3
    assert body["max_task_id"] >= third  # ids the replay was stamped with count too
    assert abs(body["end_ms"] - node.clock_ms()) <= 5_000
    _error(await client.get("/api/v1/stats/throughput?x=1"), 400, "invalid_request")


async def test_throughput_ignores_entries_older_than_its_window(
    api: tuple[Node, httpx.AsyncClient],
) -> None:
    node, _ = api
    recorder = ThroughputRecorder(node)
    now_ms = node.clock_ms()
    ref = [TaskRef(id=1, state="waiting")]
    spec = e.TaskSpec(id=1, type="noop", tenant="default")
    # As at boot, replaying an hour-old entry: outside the 5 minutes shown.
    recorder.on_applied(e.SubmitTasks(time_ms=now_ms - 3_600_000, tasks=(spec,)), Applied(ref))
    assert sum(recorder.series()[1]["submitted"]) == 0
    recorder.on_applied(e.SubmitTasks(time_ms=now_ms - 60_000, tasks=(spec,)), Applied(ref))
    recorder.on_applied(e.SubmitTasks(time_ms=now_ms, tasks=(spec,)), Applied(ref))
    end_ms, series = recorder.series()
    assert sum(series["submitted"]) == 2
    # A minute ago is 12 buckets of 5 s before the newest one.
    assert series["submitted"][-1] == 1 and series["submitted"][-13] == 1
    assert end_ms > now_ms >= end_ms - 5_000


# --- broker statuses ------------------------------------------------------------------------


async def test_broker_statuses_of_a_standalone_broker(api: tuple[Node, httpx.AsyncClient]) -> None:
    node, client = api
    await _submit(client)
    body = (await client.get("/api/v1/cluster/brokers")).json()
    [own] = body["brokers"]
    assert body["leader"] == body["answered_by"] == own["id"] == node.config.broker_id
    assert own["role"] == "standalone" and own["is_leader"] and own["reachable"]
    assert own["lag_entries"] == 0 and own["writable"] is True
    digest = (await client.get("/api/v1/state/digest")).json()
    assert own["position"] == digest["position"]
    assert own["uptime_secs"] >= 0
    _error(await client.get("/api/v1/cluster/brokers?x=1"), 400, "invalid_request")


async def test_workers_with_capacities_and_running_tasks(
    api: tuple[Node, httpx.AsyncClient],
) -> None:
    node, client = api
    assert (await client.get("/api/v1/workers")).json() == {"workers": []}
    await node.propose(
        lambda s: e.RegisterWorker(
            time_ms=s.now_ms,
            worker_id="w2",
            address="10.0.0.2:1",
            resources={"cpu": 4.0},
            task_types={"sleep": 2, "*": 1},
            tenants=("a",),
        )
    )
    ids = [await _submit(client, tenant="a") for _ in range(3)]
    await node.propose(
        lambda s: e.AssignTasks(
            time_ms=s.now_ms, assignments=tuple(e.Assignment(i, "w2") for i in ids[:2])
        )
    )
    body = (await client.get("/api/v1/workers")).json()
    [worker] = body["workers"]
    assert worker["id"] == "w2" and worker["state"] == "connected"
    assert worker["address"] == "10.0.0.2:1"
    assert worker["task_types"] == {"sleep": 2, "*": 1}
    assert worker["resources"] == {"cpu": 4.0} and worker["tenants"] == ["a"]
    assert worker["running_tasks"] == 2 and worker["running"] == ids[:2]
    assert worker["connected_at"].endswith("Z") and worker["reason"] is None
    _error(await client.get("/api/v1/workers?x=1"), 400, "invalid_request")


class FakeView:
    """The API's ClusterView over a real PeerTable (broker/server/peer_view.py) filled by
    hand: the polls' outcomes without the network (their own tests are elsewhere)."""

    def __init__(self, table: PeerTable, leader_id: str, now: float) -> None:
        self.table = table
        self.leader_id = leader_id
        self.now = now

    @property
    def url(self) -> str:
        return "http://self.invalid"

    @property
    def worker_address(self) -> str | None:
        return None

    @property
    def worker_tls(self) -> bool:
        return False

    @property
    def peer_ssl_context(self) -> ssl.SSLContext | None:
        return None

    def leader(self) -> m.BrokerSummary | None:
        url = f"http://{self.leader_id}.invalid"
        return m.BrokerSummary(self.leader_id, "", 0, None, True, "test", None, url=url)

    def brokers(self) -> list[m.BrokerSummary]:
        return []  # the dashboard must not need it

    def broker_summaries(self, own: m.BrokerSummary) -> list[m.BrokerSummary]:
        return self.table.summaries(own, self.leader_id, self.now)

    def coordination_problem(self) -> str | None:
        return None  # connected


def _health(role: str, ledger_id: int, entry_id: int, **more: Any) -> m.Health:
    return m.Health(
        status="ok",
        writable=role == "leader",
        role=role,
        position=m.Position(ledger_id, entry_id),
        uptime_secs=30.0,
        **more,
    )


async def test_broker_statuses_are_the_cluster_views_rows(tmp_path: Path) -> None:
    table = PeerTable("not-advertised")
    names = ("p-leader", "p-sync", "p-old", "p-down", "p-gone")
    table.set_members([{"broker_id": n, "url": f"http://{n}.invalid"} for n in names], 100.0)
    # An idle leader's last entry (7, 40) is a Confirm marker: followers stop at 39.
    leader = _health("leader", 7, 40, catch_up_position=m.Position(7, 39))
    table.record("p-leader", leader, 100.0)
    table.record("p-sync", _health("follower", 7, 39), 100.0)
    table.record("p-old", _health("follower", 6, 99), 100.0)
    table.record("p-down", "ConnectError: connection refused", 100.0)
    table.record("p-gone", _health("follower", 7, 39), 95.0)
    table.set_members([{"broker_id": n, "url": f"http://{n}.invalid"} for n in names[:4]], 104.0)
    async for node, client in _client(tmp_path, cluster=FakeView(table, "p-leader", 110.0)):
        response = await client.get("/api/v1/cluster/brokers")
        assert response.status_code == 200, response.text
        body = response.json()
        cluster = (await client.get("/api/v1/cluster")).json()
        own_id = node.config.broker_id
        assert body["leader"] == cluster["leader"] == "p-leader"
        assert body["answered_by"] == own_id and body["cluster_id"] == node.config.cluster_id
        # The same brokers in the same order, with the same values.
        assert [b["id"] for b in body["brokers"]] == [b["id"] for b in cluster["brokers"]]
        for row, summary in zip(body["brokers"], cluster["brokers"], strict=True):
            for key in ("role", "is_leader", "reachable", "position", "lag_entries", "member"):
                assert row[key] == summary[key], (key, row, summary)
            assert row["error"] == summary["unknown_reason"]
            if row["id"] != own_id:  # the answering broker's own uptime moves on
                assert row["uptime_secs"] == summary["uptime_secs"]
                assert row["last_seen_secs_ago"] == summary["last_seen_secs_ago"]
        by_id = {b["id"]: b for b in body["brokers"]}
        assert by_id["p-leader"]["lag_entries"] == 0 and by_id["p-leader"]["uptime_secs"] > 0
        assert by_id["p-sync"]["lag_entries"] == 0  # in sync: 0, not the marker's 1
        assert by_id["p-old"]["behind_ledgers"] is True and by_id["p-old"]["lag_entries"] is None
        assert by_id["p-down"]["reachable"] is False and by_id["p-down"]["role"] == "unreachable"
        assert "connection refused" in by_id["p-down"]["error"]
        gone = by_id["p-gone"]
        assert (gone["reachable"], gone["member"]) == (False, False)
        assert gone["last_seen_secs_ago"] == 15.0
        assert "left the membership" in gone["error"] and "last seen" in gone["error"]
        own = by_id[own_id]
        assert own["reachable"] and own["writable"] is True
        assert all(b["writable"] is None for b in body["brokers"] if b["id"] != own_id)
