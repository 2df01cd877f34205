"""Whether a task fits a worker: the one rule (docs/DESIGN.md §6, "Fit and admission").

The scheduler (broker/core/scheduler.py), ``apply`` checking the assignments a submit
carries (broker/core/workers.py), the placement of new tasks in their submit entry
(broker/core/placement.py) and the capacity index (broker/core/capacity.py) all ask
these functions; each caller only counts what is in use its own way (a round's views, the
state, placements in flight). Pure: no state of its own.

A task fits a worker when:

- the worker serves the task's tenant (a worker without a tenant list serves every one);
- the pool the task's type uses on it has a free slot: a type the worker lists by name
  uses its own capacity (even 0), never the ``"*"`` pool; any other type uses ``"*"``,
  or no pool at all when the worker has none;
- every resource the task asks for (a non-zero amount) is left on the worker, within
  :data:`RESOURCE_EPSILON`; a resource the worker does not declare never fits;
- and, across the cluster, no globally limited resource goes over its limit
  (:func:`within_global_limits`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Final

from broker.core.records import Task

#: The pool shared by every task type a worker does not list by name.
ANY_TYPE: Final = "*"

#: Absorbs float rounding when fractional asks add up exactly to a capacity (ten tasks of
#: 0.1 cpu on a 1-cpu worker); far below any meaningful amount.
RESOURCE_EPSILON: Final = 1e-9


def pool_of(pools: Collection[str], task_type: str) -> str | None:
    """The pool a task of ``task_type`` uses on a worker with these pools (its task types
    and capacities, or anything keyed by them), or None: the worker has no pool for it."""
    if task_type in pools:
        return task_type
    return ANY_TYPE if ANY_TYPE in pools else None


def serves_tenant(tenants: Collection[str] | None, tenant: str) -> bool:
    """Whether a worker with this tenant list (empty or None: every tenant) serves ``tenant``."""
    return not tenants or tenant in tenants


def resources_fit(asks: Mapping[str, float], free: Mapping[str, float]) -> bool:
    """Whether every non-zero ask is left in ``free`` (the worker's resources minus what
    its tasks hold); a resource missing from ``free`` never fits a non-zero ask."""
    for name, amount in asks.items():
        if amount > 0:
            left = free.get(name)
            if left is None or amount > left + RESOURCE_EPSILON:
                return False
    return True


def within_global_limits(
    asks: Mapping[str, float], limits: Mapping[str, float], used: Mapping[str, float]
) -> bool:
    """Whether the asks fit the cluster-wide limits, ``used`` being what running tasks hold
    of each limited resource (a resource without a limit is not counted)."""
    for name, amount in asks.items():
        limit = limits.get(name)
        if limit is None or amount <= 0:
            continue
        if used.get(name, 0.0) + amount > limit + RESOURCE_EPSILON:
            return False
    return True


def resources_left(resources: Mapping[str, float], holders: Iterable[Task]) -> dict[str, float]:
    """A worker's ``resources`` minus what ``holders`` (its running tasks, in task id order
    so float totals do not depend on set order) ask for of them."""
    free = dict(resources)
    if free:
        for task in holders:
            for name, amount in task.resources.items():
                if name in free:
                    free[name] -= amount
    return free


def resources_held(holders: Iterable[Task], names: Collection[str]) -> dict[str, float]:
    """What ``holders`` (in task id order, as above) hold of each resource in ``names``."""
    held = dict.fromkeys(names, 0.0)
    for task in holders:
        for name, amount in task.resources.items():
            if name in held:
                held[name] += amount
    return held


def fits(
    tenants: Collection[str] | None,
    tenant: str,
    pool_free: int,
    free: Mapping[str, float],
    asks: Mapping[str, float],
) -> bool:
    """Whether a task of ``tenant`` asking ``asks`` fits a worker serving ``tenants``, with
    ``pool_free`` slots left in the pool its type uses and ``free`` resources left."""
    return serves_tenant(tenants, tenant) and pool_free > 0 and resources_fit(asks, free)
