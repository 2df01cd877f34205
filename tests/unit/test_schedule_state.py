"""Periodic-task schedules in the state machine (broker/core/schedules.py): ticks, the
missed-tick policies, one firing per tick, snapshots; and the leader's firing loop and the
HTTP API in process (tests/support/http_api.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from broker.core import ErrorCode, Rejected, StateMachine, TaskRef
from broker.core import entries as e
from broker.core.schedules import MAX_CATCH_UP, Schedule, plan_firing, tick_after
from tests.support.auth_env import Env
from tests.support.auth_env import error_code as auth_error
from tests.support.http_api import Api, error_of
from tests.support.machine import T0, Machine
from tests.support.schedule_machine import TASK, create, fire_due, ticks_run

SCHEDULES = "/api/v1/schedules"


def test_on_time_ticks_each_create_one_task_with_the_template() -> None:
    sm = Machine()
    assert create(sm) is None
    assert fire_due(sm, T0 + 999) == []
    for k in range(1, 4):
        (result,) = fire_due(sm, T0 + k * 1_000 + 30)
        assert isinstance(result, TaskRef)
        task = sm.m.tasks[result.id]
        assert (task.type, task.tenant, task.params) == ("noop", "acme", b'{"x": 1}')
    assert ticks_run(sm) == [1_000, 2_000, 3_000]
    assert sm.m.schedules[("acme", "s")].runs == 3
    assert sm.m.schedules[("acme", "s")].next_ms == T0 + 4_000


def test_a_tick_is_handled_once_whoever_proposes_it() -> None:
    sm = Machine()
    create(sm)
    fire = e.FireSchedule(
        time_ms=T0 + 1_000, tenant="acme", name="s", tick_ms=T0 + 1_000, next_ms=T0 + 2_000
    )
    assert isinstance(sm.apply(msgspec.structs.replace(fire, task_id=1)), TaskRef)
    again = sm.apply(msgspec.structs.replace(fire, task_id=2))  # a retry, or a deposed leader
    assert isinstance(again, Rejected) and again.code == ErrorCode.CONFLICT
    assert list(sm.m.tasks) == [1]
    assert sm.m.max_task_id == 1  # a refused firing uses no id
    stale = sm.apply(msgspec.structs.replace(fire, tick_ms=T0, task_id=3))
    assert isinstance(stale, Rejected) and stale.code == ErrorCode.CONFLICT
    backwards = sm.apply(msgspec.structs.replace(fire, tick_ms=T0 + 2_000, next_ms=T0 + 2_000))
    assert isinstance(backwards, Rejected) and backwards.code == ErrorCode.INVALID
    assert len(sm.m.tasks) == 1


@pytest.mark.parametrize(
    ("missed", "grace_ms", "runs", "skipped"),
    [
        # Down from just after tick 1 s until 5.5 s: ticks 2..5 s are overdue.
        ("run_all", 60_000, [2_000, 3_000, 4_000, 5_000], 0),
        ("run_once", 0, [5_000], 3),  # once, as the latest, however late
        ("skip", 60_000, [5_000], 3),  # the latest is within grace: it runs
        ("skip", 200, [], 4),  # 500 ms late > grace: nothing runs
    ],
)
def test_missed_tick_policies(missed: str, grace_ms: int, runs: list[int], skipped: int) -> None:
    sm = Machine()
    create(sm, missed=missed, grace_ms=grace_ms)
    fire_due(sm, T0 + 1_000)
    fire_due(sm, T0 + 5_500)  # the next leader, after the outage
    schedule = sm.m.schedules[("acme", "s")]
    assert ticks_run(sm) == [1_000, *runs]
    assert (schedule.runs, schedule.skipped) == (1 + len(runs), skipped)
    assert schedule.next_ms == T0 + 6_000
    assert len(sm.m.tasks) == 1 + len(runs)


def test_run_all_is_bounded() -> None:
    sm = Machine()
    create(sm, missed="run_all")
    fire_due(sm, T0 + 1_000 * (MAX_CATCH_UP + 50))  # ticks 1 s .. 150 s are due
    schedule = sm.m.schedules[("acme", "s")]
    assert schedule.runs == MAX_CATCH_UP and schedule.skipped == 50
    assert len(sm.m.tasks) == MAX_CATCH_UP


def test_run_all_catch_up_of_a_dense_cron_schedule_is_bounded() -> None:
    sm = Machine()
    sm.apply(
        e.CreateSchedule(
            time_ms=T0,
            tenant="acme",
            name="s",
            task=TASK,
            first_ms=T0 + 60_000 - T0 % 60_000,
            cron="* * * * *",
            missed="run_all",
        )
    )
    fire_due(sm, T0 + 50 * 3_600_000)  # down for 50 hours: 3,000 minutes
    schedule = sm.m.schedules[("acme", "s")]
    assert (schedule.runs, schedule.skipped) == (MAX_CATCH_UP, 3_000 - MAX_CATCH_UP)
    assert ticks_run(sm)[-1] == 50 * 3_600_000 - T0 % 60_000


def test_cron_ticks_in_utc() -> None:
    start = int(datetime(2026, 3, 1, 10, 7, tzinfo=UTC).timestamp() * 1000)
    schedule = Schedule("acme", "c", TASK, 0, start, start, cron="*/15 * * * *")
    first = tick_after(schedule, start)
    assert first == int(datetime(2026, 3, 1, 10, 15, tzinfo=UTC).timestamp() * 1000)
    schedule.next_ms = first
    assert plan_firing(schedule, first - 1) is None
    assert plan_firing(schedule, first + 10) == (first, first + 15 * 60_000, 0)
    # Down for an hour: run_once runs the latest overdue tick only.
    schedule.missed = "run_once"
    assert plan_firing(schedule, first + 3_600_000 + 5) == (
        first + 3_600_000,
        first + 3_600_000 + 15 * 60_000,
        4,
    )


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"interval_ms": 999}, "interval must be"),
        ({"interval_ms": None, "cron": None}, "either cron or interval"),
        ({"interval_ms": 1_000, "cron": "* * * * *"}, "either cron or interval"),
        ({"missed": "sometimes"}, "missed must be"),
        ({"interval_ms": None, "cron": "R * * * *"}, "random"),
        ({"interval_ms": None, "cron": "0 H/2 * * *"}, "random"),
        ({"interval_ms": None, "cron": "* * * * *\n"}, "not valid"),
        ({"interval_ms": None, "cron": "* * * *"}, "not valid"),
        ({"interval_ms": None, "cron": "1 " * 101}, "not valid"),
    ],
)
def test_bad_schedules_are_refused(fields: dict[str, Any], fragment: str) -> None:
    sm = Machine()
    result = create(sm, **fields)
    assert isinstance(result, Rejected) and fragment in result.message
    assert sm.m.schedules == {}


def test_names_are_per_tenant_and_delete_keeps_the_tasks() -> None:
    sm = Machine()
    create(sm)
    again = create(sm)
    assert isinstance(again, Rejected) and again.code == ErrorCode.CONFLICT
    other = e.CreateSchedule(
        time_ms=T0,
        tenant="beta",
        name="s",
        task=msgspec.structs.replace(TASK, tenant="beta"),
        first_ms=T0 + 1_000,
        interval_ms=1_000,
    )
    assert sm.apply(other) is None
    fire_due(sm, T0 + 1_000)
    assert sm.apply(e.DeleteSchedule(time_ms=T0 + 1_100, tenant="acme", name="s")) is None
    gone = sm.apply(e.DeleteSchedule(time_ms=T0 + 1_100, tenant="acme", name="s"))
    assert isinstance(gone, Rejected) and gone.code == ErrorCode.NOT_FOUND
    assert list(sm.m.schedules) == [("beta", "s")] and len(sm.m.tasks) == 1


def test_a_refused_submit_still_handles_the_tick() -> None:
    sm = Machine()
    sm.apply(e.SetTenant(time_ms=T0, tenant="acme", limits=e.TenantLimitsPatch(max_waiting=1)))
    create(sm)
    fire_due(sm, T0 + 1_000)
    (refused,) = fire_due(sm, T0 + 2_000)
    assert isinstance(refused, Rejected)
    schedule = sm.m.schedules[("acme", "s")]
    assert (schedule.runs, schedule.skipped, schedule.next_ms) == (1, 1, T0 + 3_000)
    assert schedule.last_error is not None and "max_waiting" in schedule.last_error


def test_schedules_survive_a_snapshot() -> None:
    sm = Machine()
    create(sm, missed="run_all")
    fire_due(sm, T0 + 2_000)
    loaded = StateMachine.from_snapshot(sm.m.encode_snapshot())
    assert loaded.digest() == sm.m.digest()
    assert loaded.schedules == sm.m.schedules
    # The next leader carries on from the replicated next tick.
    resumed = Machine(loaded)
    fire_due(resumed, T0 + 3_000)
    assert ticks_run(resumed) == [1_000, 2_000, 3_000]


# --- the leader's loop and the HTTP API (in process) ---------------------------------------


async def test_a_schedules_tasks_carry_its_max_lost(api: Api) -> None:
    body = {"name": "lossy", "task": {"type": "noop", "max_lost": 0}, "interval_s": 1}
    created = await api.post(SCHEDULES, json=body)
    assert created.status_code == 201, created.text
    assert created.json()["task"]["max_lost"] == 0
    for _ in range(400):  # bounded: 4 s
        one = (await api.get(f"{SCHEDULES}/lossy")).json()
        if one["runs"] >= 1:
            break
        await asyncio.sleep(0.01)
    task_id = one["recent"][0]["task_id"]
    assert (await api.get(f"/api/v1/tasks/{task_id}")).json()["max_lost"] == 0
    bad = {**body, "name": "bad", "task": {"type": "noop", "max_lost": -1}}
    message = error_of(await api.post(SCHEDULES, json=bad), 400, "invalid_request")
    assert "max_lost must be between 0 and 100" in message


async def test_api_create_fires_each_tick_and_lists_reads_deletes(api: Api) -> None:
    body = {
        "name": "beat",
        "tenant": "acme",
        "task": {"type": "noop", "params": {"n": 1}},
        "interval_s": 1,
        "missed": "run_all",
    }
    created = await api.post(SCHEDULES, json=body)
    assert created.status_code == 201, created.text
    view = created.json()
    assert (view["name"], view["tenant"], view["interval_s"], view["runs"]) == (
        "beat",
        "acme",
        1.0,
        0,
    )
    assert view["task"] == {
        "type": "noop",
        "params": {"n": 1},
        "max_attempts": 1,
        "resources": {},
        "code": None,
        "max_lost": 3,
    }
    conflict = await api.post(SCHEDULES, json=body)
    assert "already exists" in error_of(conflict, 409, "conflict")
    for _ in range(400):  # bounded: 4 s
        one = (await api.get(f"{SCHEDULES}/beat", params={"tenant": "acme"})).json()
        if one["runs"] >= 2:
            break
        await asyncio.sleep(0.01)
    assert one["runs"] >= 2, one
    task_ids = [f["task_id"] for f in one["recent"]]
    tasks = [(await api.get(f"/api/v1/tasks/{i}")).json() for i in task_ids]
    assert {(t["type"], t["tenant"]) for t in tasks} == {("noop", "acme")}
    listed = (await api.get(SCHEDULES)).json()["schedules"]
    assert [s["name"] for s in listed] == ["beat"]
    assert (await api.get(SCHEDULES, params={"tenant": "other"})).json() == {"schedules": []}
    error_of(await api.get(f"{SCHEDULES}/beat"), 404, "not_found")  # tenant "default"
    deleted = await api.client.request("DELETE", f"{SCHEDULES}/beat", params={"tenant": "acme"})
    assert deleted.status_code == 200 and deleted.json()["name"] == "beat"
    error_of(await api.get(f"{SCHEDULES}/beat", params={"tenant": "acme"}), 404, "not_found")


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"interval_s": 1}, 400, "name"),
        ({"name": "a", "task": {"type": "noop"}}, 400, "either cron or interval_s"),
        ({"name": "a", "task": {"type": "noop"}, "cron": "x"}, 400, "not valid"),
        ({"name": "a", "task": {"type": "noop"}, "interval_s": 0.5}, 400, "interval_s must"),
        ({"name": "a", "task": {"type": "noop"}, "interval_s": 1, "missed": "x"}, 400, "missed"),
        ({"name": "a", "task": {"type": "noop"}, "interval_s": 1, "grace_s": 0}, 400, "grace_s"),
        ({"name": "a\n", "task": {"type": "noop"}, "interval_s": 1}, 400, "name"),
        ({"name": "a", "task": {"type": "noop"}, "cron": "R * * * *"}, 400, "random"),
        ({"name": "a", "task": {"type": "noop"}, "cron": "61 * * * *"}, 400, "not valid"),
        ({"name": "a", "task": {"type": "noop"}, "cron": "0 0 31 2 *"}, 400, "never fires"),
        ({"name": "a", "task": {"type": "sleep", "params": {"s": 1}}, "interval_s": 1}, 400, "s"),
        ({"name": "a", "task": {"type": "noop", "slot": "x"}, "interval_s": 1}, 400, "slot"),
        ({"name": "a", "task": {"type": "noop", "code": "0" * 64}, "interval_s": 1}, 404, ""),
    ],
)
async def test_api_bad_schedules_are_clear_4xx(
    api: Api, body: dict[str, Any], status: int, fragment: str
) -> None:
    response = await api.post(SCHEDULES, json=body)
    code = "not_found" if status == 404 else "invalid_request"
    assert fragment in error_of(response, status, code)
    assert (await api.get(SCHEDULES)).json() == {"schedules": []}


# --- tenant isolation (authentication on: tests/support/auth_env.py) -----------------------


async def test_schedules_belong_to_their_tenant(env: Env) -> None:
    body = {"name": "nightly", "task": {"type": "noop"}, "cron": "0 2 * * *"}
    created = await env.call("alice", "POST", SCHEDULES, json=body)  # the token's tenant
    assert created.status_code == 201 and created.json()["tenant"] == "alice", created.text
    forbidden = await env.call("alice", "POST", SCHEDULES, json={**body, "tenant": "bob"})
    assert auth_error(forbidden, 403) == "forbidden"
    # Names are per tenant: bob's own "nightly" is another schedule.
    assert (await env.call("bob", "POST", SCHEDULES, json=body)).status_code == 201
    as_bob = (await env.call("bob", "GET", SCHEDULES)).json()["schedules"]
    assert [(s["tenant"], s["name"]) for s in as_bob] == [("bob", "nightly")]
    other = await env.call("bob", "GET", f"{SCHEDULES}/nightly", params={"tenant": "alice"})
    assert auth_error(other, 403) == "forbidden"
    before = env.node.state.digest()
    refused = await env.call("bob", "DELETE", f"{SCHEDULES}/nightly", params={"tenant": "alice"})
    assert auth_error(refused, 403) == "forbidden" and env.node.state.digest() == before
    for who in ("worker", "peer", "nobody"):
        assert (await env.call(who, "GET", SCHEDULES)).status_code in (401, 403)
        assert (await env.call(who, "POST", SCHEDULES, json=body)).status_code in (401, 403)
    everyone = (await env.call("admin", "GET", SCHEDULES)).json()["schedules"]
    assert sorted(s["tenant"] for s in everyone) == ["alice", "bob"]
    gone = await env.call("admin", "DELETE", f"{SCHEDULES}/nightly", params={"tenant": "alice"})
    assert gone.status_code == 200 and gone.json()["tenant"] == "alice"
    assert list(env.node.state.schedules) == [("bob", "nightly")]


async def test_a_schedule_whose_ticks_cannot_be_computed_does_not_stop_the_others(
    api: Api,
) -> None:
    # Apply checks a cron expression's shape only (not croniter's verdict, which may change
    # with its version): one this croniter refuses is logged and left alone by the leader.
    spec = msgspec.structs.replace(TASK, tenant="acme")
    for name, cron, interval in (("bad", "61 * * * *", None), ("good", None, 1_000)):

        def build(stamp: Any, name: str = name, cron: Any = cron, interval: Any = interval) -> Any:
            return e.CreateSchedule(
                time_ms=stamp.now_ms,
                tenant="acme",
                name=name,
                task=spec,
                first_ms=stamp.now_ms + 1_000,
                cron=cron,
                interval_ms=interval,
            )

        assert await api.node.propose(build) is None
    for _ in range(400):  # bounded: 4 s
        if api.node.state.schedules[("acme", "good")].runs >= 2:
            break
        await asyncio.sleep(0.01)
    assert api.node.state.schedules[("acme", "good")].runs >= 2
    assert api.node.state.schedules[("acme", "bad")].runs == 0
    listed = (await api.get(SCHEDULES, params={"tenant": "acme"})).json()["schedules"]
    assert sorted(s["name"] for s in listed) == ["bad", "good"]
