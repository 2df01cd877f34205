"""Handlers of periodic-task schedules: create, list, read, delete, pause and resume
(broker/core/schedules.py)."""

from __future__ import annotations

import math
from typing import Final

import msgspec
from msgspec import UnsetType

from broker.api import api_models as m
from broker.api.common import (
    HttpError,
    Request,
    admission_error,
    decode,
    iso_ms,
    json_encoder,
    rejected_error,
)
from broker.api.context import ApiContext
from broker.core import NAME_RE, Rejected
from broker.core import entries as e
from broker.core.admission import admission_problem
from broker.core.schedules import (
    MAX_INTERVAL_MS,
    MIN_INTERVAL_MS,
    Missed,
    Schedule,
    cron_problem,
    tick_after,
)
from broker.replication.node import Stamp
from broker.security.auth import Role as CallerRole

_create_decoder: Final = msgspec.json.Decoder(m.ScheduleCreate)


def _view(schedule: Schedule) -> m.ScheduleView:
    spec = schedule.task
    return m.ScheduleView(
        name=schedule.name,
        tenant=schedule.tenant,
        task=m.ScheduledTask(
            type=spec.type,
            params=msgspec.Raw(spec.params),
            max_attempts=spec.max_attempts,
            resources=spec.resources,
            code=spec.code,
            max_lost=spec.max_lost,
        ),
        missed=schedule.missed,
        grace_s=schedule.grace_ms / 1000,
        next_tick=iso_ms(schedule.next_ms) or "",
        created=iso_ms(schedule.created_ms) or "",
        runs=schedule.runs,
        skipped=schedule.skipped,
        recent=[m.ScheduleFiring(iso_ms(f.tick_ms) or "", f.task_id) for f in schedule.history],
        paused=schedule.paused_ms is not None,
        paused_at=iso_ms(schedule.paused_ms),
        cron=schedule.cron,
        interval_s=None if schedule.interval_ms is None else schedule.interval_ms / 1000,
        last_error=schedule.last_error,
    )


def _seconds_ms(value: float, field: str, low_ms: int, high_ms: int) -> int:
    if not (math.isfinite(value) and low_ms <= value * 1000 <= high_ms):
        raise HttpError(
            400,
            "invalid_request",
            f"{field} must be between {low_ms / 1000:g} and {high_ms / 1000:g} seconds",
        )
    return round(value * 1000)


def _task_spec(api: ApiContext, tenant: str, task: m.ScheduledTask) -> e.TaskSpec:
    params = b"null" if isinstance(task.params, UnsetType) else bytes(task.params)
    spec = e.TaskSpec(
        id=0,
        type=task.type,
        tenant=tenant,
        params=params,
        max_attempts=task.max_attempts,
        resources=task.resources,
        code=task.code,
        max_lost=task.max_lost,
    )
    problem = admission_problem(
        api.node.state,
        spec,
        max_params_bytes=api.config.max_params_bytes,
        code_owners_enforced=api.config.auth.enabled,
        code_must_exist=True,
    )
    if problem is not None:
        raise admission_error(problem, "task: ")
    return spec


async def create_schedule(api: ApiContext, request: Request) -> tuple[int, bytes]:
    body = decode(_create_decoder, request.body)
    tenant = api.tenant_of(request, body.tenant)
    if not NAME_RE.match(tenant):
        raise HttpError(400, "invalid_request", "tenant name is not valid")
    if not NAME_RE.match(body.name):
        raise HttpError(400, "invalid_request", "schedule name is not valid")
    if (body.cron is None) == (body.interval_s is None):
        raise HttpError(400, "invalid_request", "give either cron or interval_s")
    if body.missed not in {p.value for p in Missed}:
        raise HttpError(400, "invalid_request", "missed must be skip, run_once or run_all")
    if body.cron is not None and (problem := cron_problem(body.cron)) is not None:
        raise HttpError(400, "invalid_request", problem)
    interval_ms = None
    if body.interval_s is not None:
        interval_ms = _seconds_ms(body.interval_s, "interval_s", MIN_INTERVAL_MS, MAX_INTERVAL_MS)
    # At least 1 s: the leader fires a tick some milliseconds after its time.
    grace_ms = _seconds_ms(body.grace_s, "grace_s", 1_000, MAX_INTERVAL_MS)
    spec = _task_spec(api, tenant, body.task)

    def build(stamp: Stamp) -> e.Entry:
        # The first tick: one interval from now, or the cron expression's next (UTC).
        probe = Schedule(tenant, body.name, spec, 0, stamp.now_ms, 0, interval_ms, body.cron)
        return e.CreateSchedule(
            time_ms=stamp.now_ms,
            tenant=tenant,
            name=body.name,
            task=spec,
            first_ms=tick_after(probe, stamp.now_ms),
            interval_ms=interval_ms,
            cron=body.cron,
            missed=body.missed,
            grace_ms=grace_ms,
            # 5 when the template has its own max_lost (else the type's own, 3).
            v=e.submit_version((spec,)),
        )

    result = await api.node.propose(build)
    if isinstance(result, Rejected):
        raise rejected_error(result)
    return 201, json_encoder.encode(_view(api.node.state.schedules[(tenant, body.name)]))


def _scope(api: ApiContext, request: Request) -> str:
    """The tenant whose schedules a read or delete names: a tenant token's own, else the
    ``tenant`` query parameter (default "default")."""
    principal = request.principal
    stated = request.query.get("tenant")
    if principal.role is CallerRole.TENANT:
        assert principal.tenant is not None
        if stated is not None and stated != principal.tenant:
            raise HttpError(
                403, "forbidden", f"this token acts for tenant {principal.tenant!r} only"
            )
        return principal.tenant
    return stated if stated is not None else "default"


def _named(api: ApiContext, request: Request) -> tuple[str, str]:
    unknown = set(request.query) - {"tenant"}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameter {sorted(unknown)[0]!r}")
    key = (_scope(api, request), request.params[0])
    if key not in api.node.state.schedules:
        raise HttpError(
            404, "not_found", f"schedule {key[1]!r} of tenant {key[0]!r} does not exist"
        )
    return key


async def list_schedules(api: ApiContext, request: Request) -> tuple[int, bytes]:
    unknown = set(request.query) - {"tenant"}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameter {sorted(unknown)[0]!r}")
    principal = request.principal
    wanted = request.query.get("tenant")
    if principal.role is CallerRole.TENANT:
        wanted = _scope(api, request)
    views = [
        _view(s)
        for s in api.node.state.schedules.values()
        if (wanted is None or s.tenant == wanted) and principal.may_see_tenant(s.tenant)
    ]
    return 200, json_encoder.encode(m.ScheduleList(views))


async def get_schedule(api: ApiContext, request: Request) -> tuple[int, bytes]:
    key = _named(api, request)
    return 200, json_encoder.encode(_view(api.node.state.schedules[key]))


async def delete_schedule(api: ApiContext, request: Request) -> tuple[int, bytes]:
    tenant, name = _named(api, request)
    view = _view(api.node.state.schedules[(tenant, name)])
    result = await api.node.propose(
        lambda stamp: e.DeleteSchedule(time_ms=stamp.now_ms, tenant=tenant, name=name)
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    return 200, json_encoder.encode(view)  # the schedule as it was


async def pause_schedule(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return await _set_paused(api, request, paused=True)


async def resume_schedule(api: ApiContext, request: Request) -> tuple[int, bytes]:
    return await _set_paused(api, request, paused=False)


async def _set_paused(api: ApiContext, request: Request, *, paused: bool) -> tuple[int, bytes]:
    key = _named(api, request)
    tenant, name = key
    # Already so: answered from the state, with no entry (the state holds only durable
    # entries, so the pause or resume that made it so is durable; a log entry would change
    # nothing). Two concurrent requests may both log one: the second applies as a no-op.
    if (api.node.state.schedules[key].paused_ms is not None) != paused:
        result = await api.node.propose(
            lambda stamp: e.PauseSchedule(
                time_ms=stamp.now_ms, tenant=tenant, name=name, paused=paused
            )
        )
        if isinstance(result, Rejected):
            raise rejected_error(result)  # deleted meanwhile: 404
    schedule = api.node.state.schedules.get(key)
    if schedule is None:  # deleted right after
        raise HttpError(404, "not_found", f"schedule {name!r} of tenant {tenant!r} does not exist")
    return 200, json_encoder.encode(_view(schedule))
