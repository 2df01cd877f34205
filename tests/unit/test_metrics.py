"""Prometheus metrics (broker/observability/metrics.py): scrape ``/metrics`` of an in-process
ApiApp and check every family appears and moves as tasks are submitted, assigned, finished, failed
and cancelled; group commits, snapshots and a follower's lag, on real nodes over memory
ledgers."""

from __future__ import annotations

import asyncio
import platform
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.api.http_api import ApiApp, ApiConfig
from broker.core import entries as e
from broker.observability.metrics import BUILTIN_TASK_TYPES
from broker.replication.node import VERSION, Node, Stamp
from tests.support.ledger_backends import MemoryBackend, cluster_node
from tests.support.memory_node import memory_node

WAIT_S = 30.0

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Scraper:
    def __init__(self, node: Node, client: httpx.AsyncClient) -> None:
        self.node = node
        self.client = client

    async def families(self) -> dict[str, list[tuple[str, dict[str, str], float]]]:
        response = await self.client.get("/metrics")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        return {
            family.name: [(s.name, dict(s.labels), s.value) for s in family.samples]
            for family in text_string_to_metric_families(response.text)
        }

    async def samples(self) -> Samples:
        found: Samples = {}
        for samples in (await self.families()).values():
            for name, labels, value in samples:
                found[(name, tuple(sorted(labels.items())))] = value
        return found


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
async def scraper(tmp_path: Path) -> AsyncIterator[Scraper]:
    node = memory_node(tmp_path)
    await node.start()
    app = ApiApp(node, ApiConfig())
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        try:
            yield Scraper(node, client)
        finally:
            await node.stop(snapshot=False)
            await node.ledgers.close()


async def submit(scraper: Scraper, tenant: str, task_type: str = "noop", **more: object) -> int:
    response = await scraper.client.post(
        "/api/v1/tasks", json={"type": task_type, "tenant": tenant, **more}
    )
    assert response.status_code == 201, response.text
    task_id: int = response.json()["id"]
    return task_id


async def register(node: Node) -> None:
    # "flaky" is declared (a type label of its own); "*" takes the rest (labelled other).
    task_types = {"flaky": 10, "*": 100}
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types=task_types)
    )


async def assign(node: Node, *task_ids: int) -> None:
    assignments = tuple(e.Assignment(t, "w") for t in task_ids)
    await node.propose(lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=assignments))


async def finish(node: Node, task_id: int, *, ok: bool, attempt: int = 1) -> None:
    outcome = e.TaskOutcome(
        task_id=task_id,
        worker_id="w",
        attempt=attempt,
        ok=ok,
        result=b"1" if ok else None,
        error=None if ok else "ValueError: boom\n\nTraceback ...",
    )
    await node.propose(lambda s: e.FinishTasks(time_ms=s.now_ms, outcomes=(outcome,)))


REQUIRED_FAMILIES = {
    "steward_tasks_submitted": "counter",
    "steward_task_submissions_rejected": "counter",
    "steward_tasks_assigned": "counter",
    "steward_tasks_finished": "counter",
    "steward_tasks_failed": "counter",
    "steward_tasks_cancelled": "counter",
    "steward_task_attempt_failures": "counter",
    "steward_queue_length": "gauge",
    "steward_tasks": "gauge",
    "steward_workers_connected": "gauge",
    "steward_workers_disconnected": "gauge",
    "steward_log_append_latency_seconds": "histogram",
    "steward_log_group_commit_entries": "histogram",
    "steward_follower_lag_seconds": "gauge",
    "steward_follower_lag_entries": "gauge",
    "steward_leader_changes": "counter",
    "steward_leaderships_acquired": "counter",
    "steward_snapshot_duration_seconds": "histogram",
    "steward_snapshot_size_bytes": "gauge",
    "steward_snapshot_body_bytes": "gauge",
    "steward_broker_role": "gauge",
    "steward_log_position_ledger": "gauge",
    "steward_log_position_entry": "gauge",
    "steward_entries_applied": "counter",
    "steward_schedules": "gauge",
    "steward_schedules_paused": "gauge",
    "steward_schedule_ticks_fired": "counter",
    "steward_schedule_ticks_missed": "counter",
    "steward_schedule_ticks_refused": "counter",
}


async def test_every_metric_family_is_served_in_the_text_format(scraper: Scraper) -> None:
    response = await scraper.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    types = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    missing = {name for name in REQUIRED_FAMILIES if name not in types}
    assert not missing, f"families not served: {sorted(missing)}"
    assert {n: types[n] for n in REQUIRED_FAMILIES} == REQUIRED_FAMILIES
    samples = await scraper.samples()
    assert value(samples, "steward_broker_role", role="standalone") == 1
    # A POST is refused with a JSON error, like every other wrong method.
    refused = await scraper.client.post("/metrics")
    assert refused.status_code == 405
    assert refused.json()["error"]["code"] == "method_not_allowed"


async def test_task_counters_and_queue_lengths_move_with_the_tasks(scraper: Scraper) -> None:
    node = scraper.node
    before = await scraper.samples()
    assert value(before, "steward_tasks_submitted_total", tenant="acme", type="noop") == 0

    await register(node)
    ids = [await submit(scraper, "acme") for _ in range(4)]
    retried = await submit(scraper, "acme", "flaky", max_attempts=2)
    await submit(scraper, "beta", "sleep")
    samples = await scraper.samples()
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="noop") == 4
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="flaky") == 1
    assert value(samples, "steward_tasks_submitted_total", tenant="beta", type="sleep") == 1
    assert value(samples, "steward_queue_length", tenant="acme") == 5
    assert value(samples, "steward_queue_length", tenant="beta") == 1
    assert value(samples, "steward_tasks", tenant="acme", state="waiting") == 5

    await assign(node, ids[0], ids[1], ids[2], retried)
    samples = await scraper.samples()
    assert value(samples, "steward_workers_connected") == 1
    assert value(samples, "steward_tasks_assigned_total", tenant="acme", type="noop") == 3
    assert value(samples, "steward_tasks_assigned_total", tenant="acme", type="flaky") == 1
    assert value(samples, "steward_queue_length", tenant="acme") == 1
    assert value(samples, "steward_tasks", tenant="acme", state="running") == 4

    await finish(node, ids[0], ok=True)
    await finish(node, ids[1], ok=False)  # max_attempts 1: failed for good
    await finish(node, retried, ok=False)  # attempt 1 of 2: back in the queue
    cancel = await scraper.client.post(f"/api/v1/tasks/{ids[3]}/cancel")
    assert cancel.status_code == 200, cancel.text
    samples = await scraper.samples()
    assert value(samples, "steward_tasks_finished_total", tenant="acme", type="noop") == 1
    assert value(samples, "steward_tasks_failed_total", tenant="acme", type="noop") == 1
    assert value(samples, "steward_tasks_failed_total", tenant="acme", type="flaky") == 0
    assert value(samples, "steward_task_attempt_failures_total", tenant="acme", type="noop") == 1
    assert value(samples, "steward_task_attempt_failures_total", tenant="acme", type="flaky") == 1
    assert value(samples, "steward_tasks_cancelled_total", tenant="acme", type="noop") == 1
    assert value(samples, "steward_queue_length", tenant="acme") == 1  # the retried one

    await assign(node, retried)
    await finish(node, retried, ok=False, attempt=2)
    samples = await scraper.samples()
    assert value(samples, "steward_tasks_failed_total", tenant="acme", type="flaky") == 1
    assert value(samples, "steward_task_attempt_failures_total", tenant="acme", type="flaky") == 2
    assert value(samples, "steward_tasks_assigned_total", tenant="acme", type="flaky") == 2
    # A stale report (the attempt is over) counts nothing.
    await finish(node, ids[2], ok=False, attempt=7)
    after = await scraper.samples()
    assert value(after, "steward_task_attempt_failures_total", tenant="acme", type="noop") == 1


async def fire(node: Node, name: str, *, skipped: int = 0, tick_ms: int | None = None) -> object:
    """Log the firing of schedule ``name``'s next tick (or ``tick_ms``), as the leader's
    loop would, ``skipped`` missed ticks dropped."""
    schedule = node.state.schedules[("acme", name)]
    tick = schedule.next_ms if tick_ms is None else tick_ms
    return await node.propose(
        lambda s: e.FireSchedule(
            time_ms=s.now_ms,
            tenant="acme",
            name=name,
            tick_ms=tick,
            next_ms=tick + 3_600_000,
            task_id=s.task_ids(1)[0],
            skipped=skipped,
        )
    )


async def test_schedules_and_their_ticks_fired_missed_and_refused(scraper: Scraper) -> None:
    node, api = scraper.node, scraper.client
    # An hourly schedule: the leader's own loop fires nothing during the test.
    body = {"name": "beat", "tenant": "acme", "task": {"type": "noop"}, "interval_s": 3600}
    assert (await api.post("/api/v1/schedules", json=body)).status_code == 201
    samples = await scraper.samples()
    assert value(samples, "steward_schedules", tenant="acme") == 1
    assert value(samples, "steward_schedule_ticks_fired_total", tenant="acme") == 0
    assert value(samples, "steward_schedules_paused", tenant="acme") == 0

    first_tick = node.state.schedules[("acme", "beat")].next_ms
    await fire(node, "beat", skipped=2)  # two missed ticks dropped, the latest run
    await fire(node, "beat", tick_ms=first_tick)  # handled already: refused, changes nothing
    samples = await scraper.samples()
    assert value(samples, "steward_schedule_ticks_fired_total", tenant="acme") == 1
    assert value(samples, "steward_schedule_ticks_missed_total", tenant="acme") == 2
    assert value(samples, "steward_schedule_ticks_refused_total", tenant="acme") == 0
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="noop") == 1

    # The tenant's queue is full (its one task waits): the next tick's submit is refused.
    limited = await api.put("/api/v1/tenants/acme", json={"max_waiting": 1})
    assert limited.status_code == 200, limited.text
    await fire(node, "beat")
    assert node.state.schedules[("acme", "beat")].last_error is not None
    samples = await scraper.samples()
    assert value(samples, "steward_schedule_ticks_fired_total", tenant="acme") == 1
    assert value(samples, "steward_schedule_ticks_refused_total", tenant="acme") == 1
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="noop") == 1

    # Paused: counted, and a firing planned before the pause is refused but not counted as
    # a tick refused (it handled no tick).
    paused = await api.post("/api/v1/schedules/beat/pause", params={"tenant": "acme"})
    assert paused.status_code == 200, paused.text
    await fire(node, "beat")
    samples = await scraper.samples()
    assert value(samples, "steward_schedules_paused", tenant="acme") == 1
    assert value(samples, "steward_schedule_ticks_refused_total", tenant="acme") == 1

    gone = await api.delete("/api/v1/schedules/beat", params={"tenant": "acme"})
    assert gone.status_code == 200, gone.text
    assert ("steward_schedules", (("tenant", "acme"),)) not in await scraper.samples()


async def test_task_types_nobody_declared_share_one_label(scraper: Scraper) -> None:
    """Callers choose task types: 30 made-up ones add one series per counter, not 30."""
    await register(scraper.node)
    made_up = [await submit(scraper, "acme", f"bogus-{n}") for n in range(30)]
    await submit(scraper, "acme", "flaky")
    await submit(scraper, "acme", "sleep")
    await assign(scraper.node, made_up[0])
    await finish(scraper.node, made_up[0], ok=True)
    samples = await scraper.samples()
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="other") == 30
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="flaky") == 1
    assert value(samples, "steward_tasks_submitted_total", tenant="acme", type="sleep") == 1
    assert value(samples, "steward_tasks_assigned_total", tenant="acme", type="other") == 1
    assert value(samples, "steward_tasks_finished_total", tenant="acme", type="other") == 1
    labels = {dict(key[1]).get("type") for key in samples if key[0].startswith("steward_tasks_")}
    assert not {t for t in labels if t and t.startswith("bogus")}, labels


def test_the_builtin_task_types_are_the_workers() -> None:
    from clients.worker.task_api import BUILTIN_TASKS

    assert set(BUILTIN_TASKS) == BUILTIN_TASK_TYPES


async def test_http_requests_are_counted_by_route_template_and_status(
    scraper: Scraper,
) -> None:
    for task_id in (1, 2, 3):
        assert (await scraper.client.get(f"/api/v1/tasks/{task_id}")).status_code == 404
    assert (await scraper.client.get("/no/such/path")).status_code == 404
    samples = await scraper.samples()
    route = {"method": "GET", "status": "404"}
    assert value(samples, "steward_http_requests_total", route="/api/v1/tasks/{id}", **route) == 3
    assert value(samples, "steward_http_requests_total", route="other", **route) == 1
    assert (
        value(
            samples,
            "steward_http_request_duration_seconds_count",
            route="/api/v1/tasks/{id}",
            **route,
        )
        == 3
    )
    assert not [key for key in samples if key[0].endswith("_created")]
    assert value(samples, "steward_build_info", version=VERSION, python_version=
                 platform.python_version()) == 1  # fmt: skip
    assert value(samples, "process_cpu_seconds_total") > 0


async def test_refused_and_replayed_submissions(scraper: Scraper) -> None:
    limits = await scraper.client.put("/api/v1/tenants/small", json={"max_waiting": 1})
    assert limits.status_code == 200, limits.text
    await submit(scraper, "small")
    full = await scraper.client.post("/api/v1/tasks", json={"type": "noop", "tenant": "small"})
    assert full.status_code == 429, full.text
    key = {"Idempotency-Key": "once"}
    for _ in range(3):
        response = await scraper.client.post(
            "/api/v1/tasks", json={"type": "noop", "tenant": "keyed"}, headers=key
        )
        assert response.status_code in (200, 201), response.text
    samples = await scraper.samples()
    assert value(samples, "steward_tasks_submitted_total", tenant="small", type="noop") == 1
    assert (
        value(
            samples,
            "steward_task_submissions_rejected_total",
            tenant="small",
            code="tenant_queue_full",
        )
        == 1
    )
    # An idempotent retry creates nothing, so it counts nothing.
    assert value(samples, "steward_tasks_submitted_total", tenant="keyed", type="noop") == 1


async def test_group_commit_sizes_and_append_latency(scraper: Scraper) -> None:
    node = scraper.node

    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(id=task_id, type="noop", tenant="batch", params=msgspec.json.encode(1))
        return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

    before = await scraper.samples()
    # Proposals started in one loop iteration reach the ledger before its flush: one batch.
    await asyncio.gather(*(node.propose(build) for _ in range(10)))
    samples = await scraper.samples()

    def delta(name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    appended = delta("steward_log_append_latency_seconds_count")
    assert appended >= 10
    assert delta("steward_log_append_latency_seconds_sum") >= 0
    # Every durable entry is in exactly one group commit; these 10 were one.
    assert delta("steward_log_group_commit_entries_sum") == appended
    assert delta("steward_log_group_commit_entries_bucket", le="8.0") < delta(
        "steward_log_group_commit_entries_count"
    )
    assert value(samples, "steward_entries_applied_total") >= 10
    assert value(samples, "steward_log_position_entry") >= 9


async def test_snapshot_duration_and_size(scraper: Scraper) -> None:
    await submit(scraper, "acme")
    await scraper.node.take_snapshot()
    samples = await scraper.samples()
    assert value(samples, "steward_snapshot_duration_seconds_count") == 1
    assert value(samples, "steward_snapshot_duration_seconds_sum") > 0
    assert value(samples, "steward_snapshot_size_bytes") > 0
    assert value(samples, "steward_snapshot_body_bytes") > 0


async def test_follower_lag_and_leader_only_task_counters(tmp_path: Path) -> None:
    backend = MemoryBackend(tmp_path)
    leader = cluster_node(backend, tmp_path, "leader", "metrics")
    follower = cluster_node(backend, tmp_path, "follower", "metrics")

    def build(stamp: Stamp) -> e.Entry:
        [task_id] = stamp.task_ids(1)
        spec = e.TaskSpec(id=task_id, type="noop", tenant="t")
        return e.SubmitTasks(time_ms=stamp.now_ms, tasks=(spec,))

    following: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(WAIT_S):
            await leader.boot()
            await leader.recover_log()
            await leader.open_for_writes()
            for _ in range(5):
                await leader.propose(build)
            await follower.boot()
            following = asyncio.create_task(follower.follow())
            for _ in range(int(WAIT_S / 0.02)):
                if follower.state.digest() == leader.state.digest():
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the follower never caught up with the leader")
        scrape = {
            f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
            for f in text_string_to_metric_families(follower.metrics.render().decode())
        }
        assert scrape["steward_broker_role"] == {(("role", "follower"),): 1.0}
        lag_s = scrape["steward_follower_lag_seconds"][()]
        assert 0 <= lag_s < WAIT_S
        assert scrape["steward_follower_lag_entries"][()] >= 0
        # Followers apply the same entries but count no tasks: only the leader does.
        assert scrape["steward_tasks_submitted"] == {}
        assert scrape["steward_queue_length"] == {(("tenant", "t"),): 5.0}
        leader_scrape = leader.metrics.render().decode()
        assert 'steward_tasks_submitted_total{tenant="t",type="noop"} 5.0' in leader_scrape
        assert "steward_follower_lag_seconds 0.0" in leader_scrape
    finally:
        if following is not None:
            following.cancel()
            with pytest.raises(asyncio.CancelledError):
                await following
        for node in (leader, follower):
            await node.step_down("test over")
        await backend.close()
