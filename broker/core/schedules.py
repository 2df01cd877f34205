"""Periodic tasks: schedules that create a task at each tick of a cron expression or an
interval (docs/DESIGN.md §6, "Periodic tasks").

A schedule is replicated state: its definition and ``next_ms``, the next tick not yet
handled. Only the leader fires (broker/replication/schedule_loop.py): it plans a firing
from the replicated schedule and the clock (:func:`plan_firing`, pure, so a new leader
plans from exactly what the old one left) and logs one ``FireSchedule`` entry that both
creates the tick's task and advances ``next_ms``. Apply accepts a firing only for the
tick the schedule is at, so a tick is handled at most once whoever proposes it, and the
task exists exactly when the tick was handled (same entry): once per tick across
failovers. Ticks are in UTC milliseconds; cron expressions are evaluated by croniter
(pure: no clock, it is handed the instant).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Final

import msgspec
from croniter import croniter  # type: ignore[import-untyped]  # (no type hints shipped)

from broker.core import entries as e
from broker.core.books import Books
from broker.core.records import DEFAULT_GRACE_MS as DEFAULT_GRACE_MS
from broker.core.records import ErrorCode, Firing, Rejected, TaskRef
from broker.core.records import Missed as Missed
from broker.core.records import Schedule as Schedule
from broker.core.tasks import submit_one
from broker.core.validation import NAME_RE, validate_task_spec

#: Bounds of an interval schedule's period.
MIN_INTERVAL_MS: Final = 1_000
MAX_INTERVAL_MS: Final = 366 * 86_400_000
#: At most this many schedules per tenant.
MAX_SCHEDULES_PER_TENANT: Final = 1_000
#: run_all runs at most this many missed ticks; older ones are skipped.
MAX_CATCH_UP: Final = 100
#: Firings a schedule remembers (newest last), for the API and the acceptance test.
HISTORY: Final = 32
#: The longest cron expression taken.
MAX_CRON_CHARS: Final = 200
_CRON_CHARS: Final = re.compile(r"[ -~]+")  # printable ASCII, no newline
_RANDOM_FIELD: Final = re.compile(r"(?i)(?:^|[\s,/-])[RH](?=$|[\s,/(-])")
#: Counting skipped cron ticks stops here (a long outage of a dense schedule): ``skipped``
#: then says at least this many.
_MAX_COUNTED: Final = 10_000


def cron_shape_problem(expression: str) -> str | None:
    """What apply checks of a cron expression: its shape only. Whether croniter takes it
    is checked by the API (cron_problem), so that apply does not depend on croniter's
    version (brokers of a rolling upgrade must agree on every entry)."""
    if _RANDOM_FIELD.search(expression):
        # croniter's R (random) and H (hashed) would give each leader other ticks.
        return "cron expression: R (random) and H (hashed) are not supported"
    if (
        len(expression) > MAX_CRON_CHARS
        or not _CRON_CHARS.fullmatch(expression)
        or len(expression.split()) not in (5, 6)
    ):
        shown = expression[:MAX_CRON_CHARS]
        return f"cron expression {shown!r} is not valid (5 fields, or 6 with seconds)"
    return None


def cron_problem(expression: str) -> str | None:
    """Whether the API takes a cron expression: its shape, and croniter parses it and
    finds a tick."""
    problem = cron_shape_problem(expression)
    if problem is None and not croniter.is_valid(expression):
        problem = f"cron expression {expression!r} is not valid (5 fields, or 6 with seconds)"
    if problem is not None:
        return problem
    try:
        _cron(expression, 0).get_next(float)
    except Exception:  # croniter's own errors (e.g. CroniterBadDateError): never fires
        return f"cron expression {expression!r} never fires"
    return None


def _cron(expression: str, at_ms: int) -> croniter:
    walker: croniter = croniter(expression, datetime.fromtimestamp(at_ms / 1000, UTC))
    return walker


def tick_after(schedule: Schedule, after_ms: int) -> int:
    """The first tick strictly after ``after_ms``."""
    if schedule.interval_ms is not None:
        periods = max(0, (after_ms - schedule.anchor_ms) // schedule.interval_ms + 1)
        return schedule.anchor_ms + periods * schedule.interval_ms
    assert schedule.cron is not None
    next_s: float = _cron(schedule.cron, after_ms).get_next(float)
    return round(next_s * 1000)


def _ticks_back(schedule: Schedule, now_ms: int, count: int) -> list[int]:
    """Up to ``count`` latest ticks at or before ``now_ms`` and not before next_ms, newest
    first."""
    found: list[int] = []
    if schedule.interval_ms is not None:
        last = now_ms - (now_ms - schedule.anchor_ms) % schedule.interval_ms
        while len(found) < count and last >= schedule.next_ms:
            found.append(last)
            last -= schedule.interval_ms
        return found
    assert schedule.cron is not None
    walker = _cron(schedule.cron, now_ms + 1)  # get_prev is strictly before its start
    while len(found) < count:
        tick = round(walker.get_prev(float) * 1000)
        if tick < schedule.next_ms:
            break
        found.append(tick)
    return found


def _due_count(schedule: Schedule, now_ms: int) -> int:
    if schedule.interval_ms is not None:
        return max(0, (now_ms - schedule.next_ms) // schedule.interval_ms + 1)
    return len(_ticks_back(schedule, now_ms, _MAX_COUNTED))


def plan_firing(schedule: Schedule, now_ms: int) -> tuple[int | None, int, int] | None:
    """The leader's next firing of ``schedule`` at ``now_ms``: (the tick whose task to
    create, or None; the new next_ms; ticks skipped), or None when nothing is due (or it
    is paused)."""
    if schedule.next_ms > now_ms or schedule.paused_ms is not None:
        return None
    policy = Missed(schedule.missed)
    if policy is Missed.RUN_ALL:
        # Counted only as far as the bound: a catch-up plans up to 100 firings in a row.
        kept = _ticks_back(schedule, now_ms, MAX_CATCH_UP + 1)
        if len(kept) <= MAX_CATCH_UP:
            return schedule.next_ms, tick_after(schedule, schedule.next_ms), 0
        # Drop the oldest in one firing; the latest MAX_CATCH_UP then run one by one.
        return None, kept[MAX_CATCH_UP - 1], _due_count(schedule, now_ms) - MAX_CATCH_UP
    due = _due_count(schedule, now_ms)
    latest = _ticks_back(schedule, now_ms, 1)[0]
    runs = policy is Missed.RUN_ONCE or now_ms - latest <= schedule.grace_ms
    return (latest if runs else None), tick_after(schedule, now_ms), due - int(runs)


def create_schedule(books: Books, entry: e.CreateSchedule) -> Rejected | None:
    spec = entry.task
    problem = _schedule_problem(entry)
    if problem is None and spec.tenant != entry.tenant:
        problem = "the task's tenant must be the schedule's"
    if problem is None:
        problem = validate_task_spec(spec)
    if problem is not None:
        return Rejected(ErrorCode.INVALID, problem)
    key = (entry.tenant, entry.name)
    if key in books.schedules:
        return Rejected(ErrorCode.CONFLICT, f"schedule {entry.name!r} already exists")
    if sum(1 for t, _ in books.schedules if t == entry.tenant) >= MAX_SCHEDULES_PER_TENANT:
        return Rejected(
            ErrorCode.CONFLICT, f"tenant has {MAX_SCHEDULES_PER_TENANT} schedules already"
        )
    books.tenant(entry.tenant)
    books.schedules[key] = Schedule(
        tenant=entry.tenant,
        name=entry.name,
        task=msgspec.structs.replace(spec, id=0),
        next_ms=entry.first_ms,
        anchor_ms=entry.first_ms,
        created_ms=books.now_ms,
        interval_ms=entry.interval_ms,
        cron=entry.cron,
        missed=entry.missed,
        grace_ms=entry.grace_ms,
    )
    return None


def delete_schedule(books: Books, entry: e.DeleteSchedule) -> Rejected | None:
    if books.schedules.pop((entry.tenant, entry.name), None) is None:
        return Rejected(ErrorCode.NOT_FOUND, f"schedule {entry.name!r} does not exist")
    return None


def pause_schedule(books: Books, entry: e.PauseSchedule) -> Rejected | None:
    schedule = books.schedules.get((entry.tenant, entry.name))
    if schedule is None:
        return Rejected(ErrorCode.NOT_FOUND, f"schedule {entry.name!r} does not exist")
    if entry.paused and schedule.paused_ms is None:
        schedule.paused_ms = books.now_ms
    elif not entry.paused:
        # next_ms stays the first tick not handled: the ticks passed while paused are
        # missed ticks, which the leader's next firing handles by the schedule's
        # missed policy (plan_firing), so a resume runs no more than that policy says.
        schedule.paused_ms = None
    return None  # already so (a concurrent request's entry came first): a no-op


def fire_schedule(books: Books, entry: e.FireSchedule) -> TaskRef | Rejected | None:
    schedule = books.schedules.get((entry.tenant, entry.name))
    if schedule is None:
        return Rejected(ErrorCode.NOT_FOUND, f"schedule {entry.name!r} does not exist")
    if schedule.paused_ms is not None:
        # Planned by a leader before the pause was applied: the tick stays unhandled.
        return Rejected(ErrorCode.CONFLICT, f"schedule {entry.name!r} is paused")
    if entry.tick_ms != schedule.next_ms:
        # Another firing handled this tick already (a retry, or a deposed leader's).
        return Rejected(ErrorCode.CONFLICT, f"tick {entry.tick_ms} was already handled")
    if entry.next_ms <= entry.tick_ms:
        return Rejected(ErrorCode.INVALID, "next_ms must be after tick_ms")
    schedule.next_ms = entry.next_ms
    schedule.skipped += entry.skipped
    if entry.task_id is None:
        return None
    result = submit_one(books, msgspec.structs.replace(schedule.task, id=entry.task_id))
    created = result.id if isinstance(result, TaskRef) else None
    if isinstance(result, Rejected):
        schedule.skipped += 1
        schedule.last_error = f"{result.code.value}: {result.message}"
    else:
        schedule.runs += 1
    schedule.history.append(Firing(entry.run_tick_ms or entry.tick_ms, created))
    del schedule.history[:-HISTORY]
    return result


def check_schedule_invariants(books: Books) -> str | None:
    for key, schedule in books.schedules.items():
        if key != (schedule.tenant, schedule.name) or schedule.task.tenant != key[0]:
            return f"schedule {key!r} keyed wrongly"
        if schedule.tenant not in books.tenants:
            return f"schedule {key!r} of unknown tenant"
    return None


def _schedule_problem(entry: e.CreateSchedule) -> str | None:
    if not NAME_RE.match(entry.name):
        return "schedule name is not valid"
    if (entry.interval_ms is None) == (entry.cron is None):
        return "give either cron or interval_s"
    if entry.interval_ms is not None and not MIN_INTERVAL_MS <= entry.interval_ms <= (
        MAX_INTERVAL_MS
    ):
        return f"interval must be between {MIN_INTERVAL_MS} and {MAX_INTERVAL_MS} ms"
    if entry.cron is not None and (problem := cron_shape_problem(entry.cron)) is not None:
        return problem
    if entry.missed not in {m.value for m in Missed}:
        return "missed must be skip, run_once or run_all"
    if not 0 <= entry.grace_ms <= MAX_INTERVAL_MS:
        return "grace must be between 0 and 366 days"
    return None
