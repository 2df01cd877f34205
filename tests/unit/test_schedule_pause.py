"""Pausing and resuming a schedule (broker/core/schedules.py, docs/API.md "Periodic tasks"):
a paused schedule fires nothing, a resume handles the ticks passed meanwhile by its
``missed`` policy and no more, the pause survives a snapshot; and the HTTP API in process
(tests/support/http_api.py), tenant-scoped like a delete."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core import ErrorCode, Rejected, StateMachine, TaskRef
from broker.core import entries as e
from broker.core.schedules import plan_firing
from broker.core.snapshot_body import decode_snapshot_body
from tests.support.auth_env import Env
from tests.support.auth_env import error_code as auth_error
from tests.support.http_api import Api, error_of
from tests.support.machine import T0, Machine
from tests.support.schedule_machine import create, fire_due, ticks_run

SCHEDULES = "/api/v1/schedules"


def pause(sm: Machine, at_ms: int, paused: bool = True, name: str = "s") -> Any:
    return sm.apply(e.PauseSchedule(time_ms=at_ms, tenant="acme", name=name, paused=paused))


def test_a_paused_schedule_fires_nothing() -> None:
    sm = Machine()
    create(sm)
    fire_due(sm, T0 + 1_000)
    assert pause(sm, T0 + 1_500) is None
    schedule = sm.m.schedules[("acme", "s")]
    assert schedule.paused_ms == T0 + 1_500
    # The leader plans nothing for it, however late.
    assert plan_firing(schedule, T0 + 50_000) is None
    assert fire_due(sm, T0 + 50_000) == []
    # A firing planned before the pause was applied (what the leader may still propose) is
    # refused and creates no task.
    tasks = len(sm.m.tasks)
    refused = sm.apply(
        e.FireSchedule(
            time_ms=T0 + 2_000,
            tenant="acme",
            name="s",
            tick_ms=T0 + 2_000,
            next_ms=T0 + 3_000,
            task_id=sm.next_id + 1,
        )
    )
    assert isinstance(refused, Rejected) and refused.code == ErrorCode.CONFLICT
    assert "paused" in refused.message
    assert len(sm.m.tasks) == tasks
    assert (schedule.runs, schedule.skipped, schedule.next_ms) == (1, 0, T0 + 2_000)


@pytest.mark.parametrize(
    ("missed", "grace_ms", "runs", "skipped"),
    [
        # Paused over the ticks 2..10 s, resumed at 10.3 s: nine ticks were missed.
        ("skip", 60_000, [10_000], 8),  # the latest, within grace: runs; the rest dropped
        ("skip", 200, [], 9),  # the latest is 300 ms old, beyond grace: none runs
        ("run_once", 200, [10_000], 8),  # all of them once, as the latest
        ("run_all", 200, list(range(2_000, 11_000, 1_000)), 0),  # each of them
    ],
)
def test_a_resume_handles_the_ticks_passed_by_the_missed_policy(
    missed: str, grace_ms: int, runs: list[int], skipped: int
) -> None:
    sm = Machine()
    create(sm, missed=missed, grace_ms=grace_ms)
    fire_due(sm, T0 + 1_000)
    pause(sm, T0 + 1_500)
    assert fire_due(sm, T0 + 10_300) == []
    assert pause(sm, T0 + 10_300, paused=False) is None
    schedule = sm.m.schedules[("acme", "s")]
    assert schedule.paused_ms is None
    fire_due(sm, T0 + 10_300)
    assert ticks_run(sm) == [1_000, *runs]
    assert (schedule.runs, schedule.skipped) == (1 + len(runs), skipped)
    assert schedule.next_ms == T0 + 11_000
    # Then on as before.
    (result,) = fire_due(sm, T0 + 11_010)
    assert isinstance(result, TaskRef)


def test_pause_and_resume_are_idempotent_and_need_the_schedule() -> None:
    sm = Machine()
    create(sm)
    pause(sm, T0 + 100)
    assert pause(sm, T0 + 200) is None  # paused already: keeps when it was paused
    assert sm.m.schedules[("acme", "s")].paused_ms == T0 + 100
    pause(sm, T0 + 300, paused=False)
    assert pause(sm, T0 + 400, paused=False) is None
    assert sm.m.schedules[("acme", "s")].paused_ms is None
    missing = pause(sm, T0 + 500, name="nope")
    assert isinstance(missing, Rejected) and missing.code == ErrorCode.NOT_FOUND


def test_a_pause_survives_a_snapshot_and_changes_the_digest() -> None:
    sm = Machine()
    create(sm)
    running = sm.m.digest()
    assert decode_snapshot_body(sm.m.encode_snapshot()).format_version == 2
    pause(sm, T0)  # same state time: only the pause differs
    assert sm.m.digest() != running
    data = sm.m.encode_snapshot()
    # A body-version-2 reader would drop paused_ms (and fire the schedule): version 3.
    assert decode_snapshot_body(data).format_version == 3
    loaded = StateMachine.from_snapshot(data)
    assert loaded.digest() == sm.m.digest()
    assert loaded.schedules[("acme", "s")].paused_ms == T0
    resumed = Machine(loaded)
    assert fire_due(resumed, T0 + 5_000) == []
    pause(resumed, T0 + 5_000, paused=False)
    assert len(fire_due(resumed, T0 + 5_000)) == 1  # skip: the latest tick, in grace


def test_pause_schedule_is_written_as_format_4() -> None:
    entry = e.PauseSchedule(time_ms=1, tenant="acme", name="s")
    assert e.decode_entry(e.encode_entry(entry)).v == 4


# --- the HTTP API (in process) -------------------------------------------------------------


async def _create(api: Api, name: str = "beat", tenant: str = "acme") -> dict[str, Any]:
    body = {"name": name, "tenant": tenant, "task": {"type": "noop"}, "interval_s": 3600}
    created = await api.post(SCHEDULES, json=body)
    assert created.status_code == 201, created.text
    view: dict[str, Any] = created.json()
    return view


async def test_api_pause_and_resume(api: Api) -> None:
    created = await _create(api)
    assert (created["paused"], created["paused_at"]) == (False, None)
    error_of(await api.post(f"{SCHEDULES}/nope/pause", params={"tenant": "acme"}), 404, "not_found")
    # Another tenant's (the tenant parameter names whose; default "default"): not found.
    error_of(await api.post(f"{SCHEDULES}/beat/pause"), 404, "not_found")
    error_of(await api.post(f"{SCHEDULES}/beat/pause", params={"tenant": "x"}), 404, "not_found")
    error_of(await api.post(f"{SCHEDULES}/beat/resume"), 404, "not_found")
    assert api.node.state.schedules[("acme", "beat")].paused_ms is None
    paused = await api.post(f"{SCHEDULES}/beat/pause", params={"tenant": "acme"})
    assert paused.status_code == 200, paused.text
    view = paused.json()
    assert view["paused"] is True and view["paused_at"], view
    assert view["next_tick"] == created["next_tick"]
    again = await api.post(f"{SCHEDULES}/beat/pause", params={"tenant": "acme"})
    assert again.status_code == 200 and again.json() == view  # unchanged
    one = (await api.get(f"{SCHEDULES}/beat", params={"tenant": "acme"})).json()
    assert (one["paused"], one["paused_at"]) == (True, view["paused_at"])
    (listed,) = (await api.get(SCHEDULES)).json()["schedules"]
    assert listed["paused"] is True
    resumed = await api.post(f"{SCHEDULES}/beat/resume", params={"tenant": "acme"})
    assert resumed.status_code == 200, resumed.text
    assert (resumed.json()["paused"], resumed.json()["paused_at"]) == (False, None)
    twice = await api.post(f"{SCHEDULES}/beat/resume", params={"tenant": "acme"})
    assert twice.status_code == 200 and twice.json() == resumed.json()
    assert api.node.state.schedules[("acme", "beat")].paused_ms is None


async def test_only_the_schedules_tenant_or_an_admin_pauses_it(env: Env) -> None:
    body = {"name": "nightly", "task": {"type": "noop"}, "cron": "0 2 * * *"}
    assert (await env.call("alice", "POST", SCHEDULES, json=body)).status_code == 201
    before = env.node.state.digest()
    for action in ("pause", "resume"):
        path = f"{SCHEDULES}/nightly/{action}"
        other = await env.call("bob", "POST", path, params={"tenant": "alice"})
        assert auth_error(other, 403) == "forbidden"
        # bob's own tenant has no schedule of that name.
        assert auth_error(await env.call("bob", "POST", path), 404) == "not_found"
        for who in ("worker", "peer", "nobody"):
            assert (await env.call(who, "POST", path)).status_code in (401, 403)
    assert env.node.state.digest() == before
    mine = await env.call("alice", "POST", f"{SCHEDULES}/nightly/pause")
    assert mine.status_code == 200 and mine.json()["paused"] is True
    path = f"{SCHEDULES}/nightly/resume"
    admin = await env.call("admin", "POST", path, params={"tenant": "alice"})
    assert admin.status_code == 200 and admin.json()["paused"] is False
