"""Seeded simulation of the replicated broker core (broker/replication/node.py) in cluster mode.

Several :class:`Node` replicas share one memory ledger cluster (log/memory.py, each
replica with its own store client) and one ledger list (the "ZooKeeper" of the test),
each with its own SnapshotStore in ``tmp_path``. A simulated elector decides who holds
the leadership lock; each replica's ``leadership_check`` reads its own, possibly stale,
view of it, and a per-replica manager mirrors broker/server/cluster.py (take over: recover_log,
open_for_writes; deposed: step_down, follow; history gap: install a peer's snapshot).

Everything runs on one asyncio loop with virtual time (it jumps to the next timer
when nothing is runnable) and snapshot IO runs inline, so a seed replays exactly.
The brokers' clock is a controllable fake (virtual time + jumps + a per-replica skew).

A seeded schedule mixes: client proposals (entries of tests/sim/test_simulation.py's
generator, valid and invalid, stamped with the leader's time) sent mostly to the
leader and sometimes to stale leaders or followers; idle time (Confirm markers);
clock jumps (timers, ledger rolls by age, retention); leader changes, polite or
silent (the old leader keeps writing: its appends must fail fenced or its ZooKeeper
check must fail); crashes (kill -9: the Node is dropped, its store loses what was not
synced yet) and restarts from its snapshots and the shared log; whole-cluster power
losses; followers paused so they lag; snapshots at random. Writes are readable before
they are durable (a sync delay), so a follower that ignores the LAC applies entries a
crash then erases.

Checked continuously: positions never move backwards on a live node; a leader only
applies (and so acknowledges) an entry while the last ledger list change is its own
and its ledger is not fenced; no acknowledgement comes from a dead incarnation; a
closed ledger's end never changes. At every settle point (a healthy leader, the
clock frozen, everyone caught up): all caught-up replicas have the digest of an
independent replay of the committed log (which only grows), every acknowledged entry
is in it with the acknowledged result, in real-time order, acknowledged submitted
tasks exist on every replica, closed ledgers hold nothing past their end (fencing),
and check_invariants() holds everywhere.

Seeds: ``STEWARD_SIM_SEEDS=N`` runs seeds 0..N-1 (``A:B`` runs A..B-1),
``STEWARD_SIM_SEED=n`` only seed n; ``STEWARD_SIM_STEPS`` sets the schedule length.
A failure names its seed, step and the reproduce command.

The machinery lives in tests/support: sim_virtual.py (virtual time, the shared ledger
list, replicas), sim_cluster.py (replicas, managers, proposals) and sim_replicated.py
(the schedule and the settle-point checks).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest

from broker.core import ApplyResult, Tenant
from broker.core import entries as e
from broker.replication.node import (
    Node,
    NodeConfig,
    Stamp,
)
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore
from tests.support.sim_common import (
    assert_exercised,
    seeds,
    stats_or_fail,
    steps,
)
from tests.support.sim_replicated import Simulation, run_seed
from tests.support.sim_virtual import VirtualTimeLoop, cancel_leftovers

DEFAULT_SEEDS: Final = 20
DEFAULT_STEPS: Final = 300


def run_simulation(seed: int, root: Path, steps: int = DEFAULT_STEPS) -> Counter[str]:
    """Run one seed; raise SimulationFailure naming the seed, step and how to reproduce."""
    return run_seed(
        lambda: Simulation(seed, steps, root),
        seed,
        steps,
        name="replicated simulation",
        reproduce="tests/sim/test_replicated.py",
    )


def _run_or_fail(seed: int, root: Path, steps: int) -> Counter[str]:
    return stats_or_fail(lambda: run_simulation(seed, root, steps))


@pytest.mark.parametrize("seed", seeds(DEFAULT_SEEDS), ids=lambda s: f"seed={s}")
def test_replicated_simulation(seed: int, tmp_path: Path) -> None:
    _run_or_fail(seed, tmp_path, steps(DEFAULT_STEPS))


def test_replicated_simulation_is_deterministic(tmp_path: Path) -> None:
    """Same seed, same run: a failure found by a seed can be replayed."""
    first = _run_or_fail(3, tmp_path / "a", 60)
    second = _run_or_fail(3, tmp_path / "b", 60)
    assert first == second


def test_replicated_simulation_covers_the_faults(tmp_path: Path) -> None:
    """The schedule really produces the faults the checks are about (guards the driver)."""
    stats: Counter[str] = Counter()
    for seed in range(4):
        stats.update(_run_or_fail(1000 + seed, tmp_path / str(seed), DEFAULT_STEPS))
    wanted = [
        "proposals acked",
        "proposals refused",
        "acked with a rejection",
        "take-overs",
        "leader change polite",
        "leader change silent",
        "leader change stale",
        "deposed: ledger list changed",
        "deposed: elector",
        "kills",
        "kill lost unsynced entries",
        "restarts",
        "follower: history gap",
        "snapshot downloads",
        "power losses",
        "follower paused",
        "snapshots",
        "settles",
        "schedule firings applied",
        "schedule firings refused",
        "schedule pauses",
        "schedule resumes",
    ]
    assert_exercised(stats, wanted)


def test_answers_are_not_changed_by_later_entries_of_the_batch(tmp_path: Path) -> None:
    """Two SetTenant in one group commit: each caller gets the tenant as its own entry
    left it (apply returns the live Tenant; the batch is applied before callers resume)."""

    async def scenario() -> tuple[ApplyResult, ApplyResult]:
        node = Node(
            NodeConfig(data_dir=tmp_path, snapshot_interval_s=3600, timer_poll_interval_s=3600),
            ledgers=MemoryLedgerStore(),
            ledger_list=MemoryLedgerListStore(),
            snapshots=SnapshotStore(tmp_path / "snapshots"),
        )
        await node.start()

        def set_tenant(max_waiting: int) -> Callable[[Stamp], e.Entry]:
            limits = e.TenantLimitsPatch(max_waiting=max_waiting)
            return lambda stamp: e.SetTenant(time_ms=stamp.now_ms, tenant="t", limits=limits)

        first = asyncio.create_task(node.propose(set_tenant(5)))
        second = asyncio.create_task(node.propose(set_tenant(0)))
        return await first, await second

    loop = VirtualTimeLoop()
    try:
        first, second = loop.run_until_complete(scenario())
        cancel_leftovers(loop)
    finally:
        loop.close()
    assert isinstance(first, Tenant) and isinstance(second, Tenant)
    assert (first.max_waiting, second.max_waiting) == (5, 0)
