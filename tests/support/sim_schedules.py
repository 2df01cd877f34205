"""Periodic-task schedules in the replicated simulation (tests/sim/test_replicated.py).

``schedule_entry`` sometimes replaces a generated proposal with a schedule's: create one
(interval or cron, any missed-tick policy), delete one, pause or resume one (mostly
toggling it, sometimes asking for what it already is), or forge a firing of a tick that
was already handled (what a deposed leader or a retry would send: it must be refused).
The replicas' own leaders fire the schedules from their schedule loop (the real one),
across the simulation's leader changes, kills, power losses and clock jumps.

``check_schedules`` runs at each settle point on the replay of the committed log: every
tick of every schedule was handled exactly once (as a run or counted as skipped), no tick
of a running schedule is left due, and the firings' ticks only move forward.
``count_firing`` checks each committed firing as it is replayed: none of a paused schedule
is applied.
"""

from __future__ import annotations

import random
from collections import Counter

from broker.core import ErrorCode, Rejected, StateMachine
from broker.core import entries as e
from broker.core.schedules import Schedule, tick_after
from broker.replication.node import Stamp

_TENANTS = ("sched-a", "sched-b")
_NAMES = ("n0", "n1", "n2")
_MISSED = ("skip", "run_once", "run_all")


def schedule_entry(
    rng: random.Random, state: StateMachine, stamp: Stamp, stats: Counter[str]
) -> e.Entry | None:
    """A schedule proposal to send instead of a generated one, or None (most of the time)."""
    roll = rng.random()
    if roll < 0.04:
        tenant, name = rng.choice(_TENANTS), rng.choice(_NAMES)
        interval = rng.choice((1_000, 1_000, 3_000, 60_000, None))
        cron = None if interval is not None else "* * * * *"
        # The first tick as the API's handler computes it.
        probe = Schedule(tenant, name, e.TaskSpec(0, "noop", tenant), 0, stamp.now_ms, 0)
        probe.interval_ms, probe.cron = interval, cron
        first = tick_after(probe, stamp.now_ms)
        stats["schedule creates"] += 1
        return e.CreateSchedule(
            time_ms=stamp.now_ms,
            tenant=tenant,
            name=name,
            task=e.TaskSpec(id=0, type="noop", tenant=tenant, params=b'{"scheduled": true}'),
            first_ms=first,
            interval_ms=interval,
            cron=cron,
            missed=rng.choice(_MISSED),
            grace_ms=rng.choice((0, 500, 60_000)),
        )
    if not state.schedules or roll >= 0.075:
        return None
    (tenant, name), schedule = rng.choice(sorted(state.schedules.items()))
    if roll < 0.05:
        stats["schedule deletes"] += 1
        return e.DeleteSchedule(time_ms=stamp.now_ms, tenant=tenant, name=name)
    if roll >= 0.06:
        paused = (schedule.paused_ms is None) == (rng.random() < 0.8)  # mostly a toggle
        stats["schedule pauses" if paused else "schedule resumes"] += 1
        return e.PauseSchedule(time_ms=stamp.now_ms, tenant=tenant, name=name, paused=paused)
    # A firing of a tick already handled (or not yet due): apply must refuse it.
    stats["schedule forged firings"] += 1
    return e.FireSchedule(
        time_ms=stamp.now_ms,
        tenant=tenant,
        name=name,
        tick_ms=schedule.next_ms - rng.choice((1, 1_000, -1)),
        next_ms=schedule.next_ms + 1,
        task_id=stamp.task_ids(1)[0],
    )


def count_firing(
    stats: Counter[str], state: StateMachine, record: e.Entry, result: object
) -> str | None:
    """Count a committed firing, just applied to ``state``: a tick handled (a task, none,
    or its submit refused, e.g. the generator's entries used the id up) or refused (that
    tick was handled already, or the schedule is paused). A problem: a paused schedule
    fired (a firing does not change the pause, so ``state`` shows it as it was)."""
    if not isinstance(record, e.FireSchedule):
        return None
    schedule = state.schedules.get((record.tenant, record.name))
    paused = schedule is not None and schedule.paused_ms is not None
    if isinstance(result, Rejected) and result.code == ErrorCode.CONFLICT:
        stats["schedule firings refused"] += 1
        if paused:
            stats["schedule firings of a paused schedule refused"] += 1
    elif isinstance(result, Rejected) and result.code == ErrorCode.NOT_FOUND:
        stats["schedule firings of a deleted schedule"] += 1
    elif paused:
        return f"schedule {record.tenant}/{record.name} fired while paused: {record}"
    else:
        stats["schedule firings applied"] += 1
    return None


def _cron_ticks(schedule: Schedule) -> int:
    """Ticks in [anchor (the first tick), next_ms)."""
    count, tick = 0, schedule.anchor_ms
    while tick < schedule.next_ms:
        count, tick = count + 1, tick_after(schedule, tick)
    return count


def check_schedules(reference: StateMachine, now_ms: int) -> str | None:
    """A problem with the replayed schedules at a settle point (the leader idle), or None."""
    for (tenant, name), schedule in reference.schedules.items():
        where = f"schedule {tenant}/{name}"
        if schedule.next_ms <= now_ms and schedule.paused_ms is None:
            return f"{where}: tick {schedule.next_ms} is due at {now_ms} but was not handled"
        if schedule.interval_ms is not None:
            handled = (schedule.next_ms - schedule.anchor_ms) // schedule.interval_ms
        else:
            handled = _cron_ticks(schedule)
        if schedule.runs + schedule.skipped != handled:
            return (
                f"{where}: {schedule.runs} runs + {schedule.skipped} skipped for "
                f"{handled} ticks handled"
            )
        ticks = [f.tick_ms for f in schedule.history]
        if ticks != sorted(set(ticks)) or (ticks and ticks[-1] >= schedule.next_ms):
            return f"{where}: firings out of order or repeated: {ticks}"
    return None
