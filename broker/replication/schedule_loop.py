"""The leader's firing of periodic tasks (docs/DESIGN.md §6, "Periodic tasks").

Each poll, every schedule with a due tick gets one ``FireSchedule`` entry planned from the
replicated schedule and the leader's clock; the state machine accepts it only for the
tick the schedule is at, so a retry or a deposed leader's proposal cannot run a tick twice
and a new leader simply carries on from the replicated ``next_ms``. A paused schedule is
planned nothing (``plan_firing``), and apply refuses a firing planned before its pause.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from broker.core import ApplyResult
from broker.core import entries as e
from broker.core.schedules import MAX_CATCH_UP, plan_firing
from broker.replication.common import BrokerUnavailableError, logger
from broker.replication.context import RoleContext
from broker.replication.stamp import Stamp


class Proposer(Protocol):
    """The leader term the loop fires for (:class:`~broker.replication.leader.Leader`)."""

    @property
    def writable(self) -> bool: ...

    async def propose(self, build: Callable[[Stamp], e.Entry]) -> ApplyResult: ...


async def fire_schedules_loop(context: RoleContext, leader: Proposer) -> None:
    # Schedules whose ticks could not be computed (a cron expression this croniter refuses,
    # logged once per term): left alone until deleted.
    broken: set[tuple[str, str]] = set()
    while True:
        await asyncio.sleep(context.config.timer_poll_interval_s)
        try:
            for key in list(context.applier.state.schedules):
                # A run_all schedule catches up its missed ticks in one poll.
                for _ in range(MAX_CATCH_UP + 1):
                    if key in broken or not leader.writable:
                        break
                    if not await _fire_once(context, leader, key, broken):
                        break
        except BrokerUnavailableError:
            continue  # stopping, or this term is over (then this task is cancelled)


async def _fire_once(
    context: RoleContext, leader: Proposer, key: tuple[str, str], broken: set[tuple[str, str]]
) -> bool:
    """Log the due firing of one schedule; False when none was due (or it failed)."""
    schedule = context.applier.state.schedules.get(key)
    try:
        plan = plan_firing(schedule, context.clock.now_ms()) if schedule is not None else None
    except Exception:
        logger.exception("schedule %s/%s: cannot compute its ticks; not fired", *key)
        broken.add(key)
        return False
    if schedule is None or plan is None:
        return False
    run_tick_ms, next_ms, skipped = plan
    tick_ms = schedule.next_ms

    def build(stamp: Stamp) -> e.Entry:
        return e.FireSchedule(
            time_ms=stamp.now_ms,
            tenant=key[0],
            name=key[1],
            tick_ms=tick_ms,
            next_ms=next_ms,
            task_id=stamp.task_ids(1)[0] if run_tick_ms is not None else None,
            run_tick_ms=run_tick_ms if run_tick_ms != tick_ms else None,
            skipped=skipped,
        )

    try:
        await leader.propose(build)
    except BrokerUnavailableError:
        raise
    except Exception:
        # One schedule must not stop the others: logged, tried again next poll.
        logger.exception("firing schedule %s/%s failed", *key)
        return False
    return True
