"""Driving schedules through the state machine by hand (tests/unit/test_schedule_state.py,
tests/unit/test_schedule_pause.py): create one of tenant "acme", and fire what the leader's
loop would fire at a given instant (broker/core/schedules.py ``plan_firing``)."""

from __future__ import annotations

from typing import Any, Final

from broker.core import entries as e
from broker.core.schedules import plan_firing
from tests.support.machine import T0, Machine

TASK: Final = e.TaskSpec(id=0, type="noop", tenant="acme", params=b'{"x": 1}')


def create(sm: Machine, name: str = "s", **fields: Any) -> Any:
    fields.setdefault("interval_ms", 1_000)
    fields.setdefault("first_ms", T0 + fields["interval_ms"] if fields["interval_ms"] else T0)
    return sm.apply(e.CreateSchedule(time_ms=T0, tenant="acme", name=name, task=TASK, **fields))


def fire_due(sm: Machine, now_ms: int, name: str = "s") -> list[Any]:
    """What the leader's loop does at ``now_ms``: fire until nothing is due."""
    results = []
    while (schedule := sm.m.schedules[("acme", name)]) and (
        plan := plan_firing(schedule, now_ms)
    ) is not None:
        run_tick, next_ms, skipped = plan
        sm.next_id += 1
        results.append(
            sm.apply(
                e.FireSchedule(
                    time_ms=now_ms,
                    tenant="acme",
                    name=name,
                    tick_ms=schedule.next_ms,
                    next_ms=next_ms,
                    task_id=sm.next_id if run_tick is not None else None,
                    run_tick_ms=run_tick if run_tick != schedule.next_ms else None,
                    skipped=skipped,
                )
            )
        )
    return results


def ticks_run(sm: Machine, name: str = "s") -> list[int]:
    return [f.tick_ms - T0 for f in sm.m.schedules[("acme", name)].history]
