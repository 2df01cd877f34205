"""Seeded simulation of task trees (Storm's acker) at scale, against an exact oracle.

A workload grows random trees through real entries: deep chains, wide fan-out, DAG
children anchored to several live tasks of the tree, unanchored (untracked) spawns, a
few anchors outside the tree; tasks fail (retried or for good), are cancelled, trees
time out and roots are replayed. :class:`TreeOracle` is an independent model fed with
each entry and its apply result: it knows the exact set of outstanding tasks of each
root's current run and predicts, entry by entry, when each tree completes (at the finish
of its last outstanding task, never earlier), fails (at once when one of its tasks fails
for good or is cancelled, or when its timeout passes), is replayed (attempt + 1, only the
root outstanding) and which tasks its failure cancels. After every entry it compares the
machine's tree records (state, attempt, ack val, deadline, live tasks), the states of
the tasks the entry touched, and the roots the machine reports as ended.

- ``test_tree_simulation``: the standalone state machine; at random points the state is
  saved to a snapshot and reloaded: the oracle continues on the restored machine while
  the original keeps applying the same entries; results and digests must stay equal.
- ``test_ten_thousand_task_tree``: one tree of exactly 10,000 tasks per shape, with a
  snapshot restore in the middle.
- ``test_trees_across_leader_changes``: tests/sim/test_replicated.py's cluster of real
  ``broker/replication/node.py`` Nodes (leader changes, kills, power losses, snapshots) runs this
  workload; the oracle checks the committed log's replay; at the end the workload lets
  every tree end (no more failures) and every tree in flight at a leader change or kill
  must have ended on a later leader; all replicas agree at every settle point.
- ``test_ten_thousand_task_trees_across_leader_changes``: the same with trees of up to
  10,000 tasks.

Seeds: ``STEWARD_SIM_SEEDS=N`` runs seeds 0..N-1 (``A:B`` runs A..B-1),
``STEWARD_SIM_SEED=n`` runs only seed n; ``STEWARD_SIM_ENTRIES`` sets the standalone
stream length, ``STEWARD_SIM_STEPS`` the replicated schedule length. A failure names its
seed, entry (or step) and the command that reproduces it.

The oracle and the workload live in tests/support/sim_trees.py.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter
from pathlib import Path
from typing import Final

import pytest

from broker.api.handlers_trees import TIMED_OUT_REASON, TREE_STATES, tree_detail
from broker.core import (
    MAX_TREE_TIMEOUT_MS,
    Applied,
    StateMachine,
    TreeRecord,
)
from broker.core import entries as e
from tests.support.sim_common import (
    SimulationFailure,
    assert_exercised,
    encode_result,
    entry_count,
    fail,
    seeds,
    stats_or_fail,
    steps,
)
from tests.support.sim_generator import EntryGenerator
from tests.support.sim_model import Expect
from tests.support.sim_replicated import Simulation, run_seed
from tests.support.sim_trees import (
    COMPLETED,
    DIGEST_EVERY,
    DRAIN_PROPOSALS_PER_ROUND,
    FAILED,
    INVARIANTS_EVERY,
    MAX_DRAIN_ROUNDS,
    PENDING,
    Shape,
    TreeOracle,
    Workload,
)
from tests.support.sim_virtual import ReferenceMachine

DEFAULT_SEEDS: Final = 12
DEFAULT_ENTRIES: Final = 1_500
DEFAULT_REPLICATED_SEEDS: Final = 8
DEFAULT_STEPS: Final = 150


# --- the standalone run -------------------------------------------------------------------


def run_standalone(
    seed: int,
    workload: Workload,
    entries: int,
    *,
    snapshot_probability: float,
    restore_at_size: int | None = None,
    stop_when_done: bool = False,
) -> Counter[str]:
    """Apply up to ``entries`` entries of ``workload`` (fewer with ``stop_when_done``: until
    every root was submitted and its tree ended); on any discrepancy raise naming the seed."""
    side = random.Random(seed ^ 0x7EE5)  # the harness's choices, not the stream's
    machine = StateMachine()
    twin: StateMachine | None = None
    oracle = TreeOracle()
    # Digests encode the whole state: rarer for big states.
    digest_every = DIGEST_EVERY if workload.max_batch < 100 else 2_000
    index = 0
    entry: e.Entry | None = None
    try:
        for index in range(entries):
            entry = e.decode_entry(e.encode_entry(workload.next_entry(machine, machine.now_ms)))
            applied = machine.apply(entry)
            result, ended = applied.result, applied.trees_ended
            oracle.observe(machine, entry, result, ended)
            if twin is not None:
                twin_applied = twin.apply(entry)
                twin_result = twin_applied.result
                if encode_result(twin_result) != encode_result(result):
                    fail(f"the pre-snapshot machine answered {twin_result!r}, not {result!r}")
                if twin_applied.trees_ended != ended:
                    fail("the pre-snapshot machine ended other trees")
                if index % digest_every == 0:
                    if twin.digest() != machine.digest():
                        fail("the restored machine's digest differs from the original's")
                    oracle.stats["digests compared"] += 1
            restore = side.random() < snapshot_probability
            if restore_at_size is not None and any(
                t.created >= restore_at_size for t in oracle.trees.values()
            ):
                restore, restore_at_size = True, None  # once, mid-tree
            if restore:
                if twin is not None and twin.digest() != machine.digest():
                    fail("the restored machine's digest differs from the original's")
                data = machine.encode_snapshot()
                restored = StateMachine.from_snapshot(data)
                restored.check_invariants()
                if restored.digest() != machine.digest():
                    fail("a restored snapshot's digest differs from the state it was taken of")
                # The oracle goes on with the restored machine; the original keeps going.
                twin, machine = machine, restored
                oracle.stats["snapshot restores"] += 1
                oracle.stats["trees pending at a restore"] += len(oracle.trees)
            if index % INVARIANTS_EVERY == 0:
                machine.check_invariants()
                oracle.stats["tree views checked"] += _check_tree_views(machine)
            if stop_when_done and workload.submitted >= workload.roots and not oracle.trees:
                break
        entries = index + 1
        index = entries
        entry = None
        machine.check_invariants()
        _check_tree_views(machine)
        if twin is not None and twin.digest() != machine.digest():
            fail("the restored machine's digest differs from the original's at the end")
    except Exception as exc:
        where = f"at entry {index}" if index < entries else "at the end"
        shown = repr(entry)[:2_000]
        crash = ""
        if not isinstance(exc, SimulationFailure):
            crash = "\n" + "".join(traceback.format_exception(exc, limit=-6))
        raise SimulationFailure(
            f"tree simulation seed {seed} failed {where}: {type(exc).__name__}: {exc}\n"
            f"reproduce with STEWARD_SIM_SEED={seed} .venv/bin/pytest "
            f"tests/sim/test_trees_sim.py\nentry: {shown}{crash}"
        ) from exc
    oracle.stats["entries"] = entries
    oracle.stats["trees pending at the end"] = len(oracle.trees)
    return oracle.stats


def _check_tree_views(machine: StateMachine) -> int:
    """Every tree's API view (broker/api/handlers_trees.py) agrees with the state it reads:
    its tasks by state are its kept tasks, its pending anchors its live ones, and
    ``timed_out`` exactly a failed tree whose last run timed out. The number checked."""
    for root, tree in machine.trees.items():
        view = tree_detail(machine, tree, machine.now_ms)
        members = machine.tree_members.get(root, set())
        live = machine.tree_live.get(root, set()) if tree.state == "pending" else set()
        if sum(view.tasks.values()) != len(members) or root not in members:
            fail(f"tree {root}'s view counts {view.tasks}, it has {len(members)} tasks")
        if view.pending_count != len(live) or not set(view.pending_anchors) <= live:
            fail(f"tree {root}'s view awaits {view.pending_count}, {len(live)} are live")
        timed_out = tree.state == "failed" and tree.reason == TIMED_OUT_REASON
        if view.state not in TREE_STATES or (view.state == "timed_out") != timed_out:
            fail(f"tree {root} ({tree.state}, {tree.reason!r}) shown as {view.state}")
    return len(machine.trees)


def _seeded_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    # Seed-level personality: big or small trees, brittle or sturdy tasks.
    big = rng.random() < 0.4
    return Workload(
        rng,
        roots_at_once=rng.choice((1, 3, 8)),
        sizes=(1, 20, 200, 2_000) if big else (1, 3, 12, 60),
        fail_probability=rng.choice((0.0, 0.01, 0.05)),
        cancel_probability=rng.choice((0.0, 0.005, 0.02)),
        max_batch=64 if big else 16,
    )


@pytest.mark.parametrize("seed", seeds(DEFAULT_SEEDS), ids=lambda s: f"seed={s}")
def test_tree_simulation(seed: int) -> None:
    stats = stats_or_fail(
        lambda: run_standalone(
            seed, _seeded_workload(seed), entry_count(DEFAULT_ENTRIES), snapshot_probability=0.004
        )
    )
    assert stats["roots"] > 0


def test_tree_simulation_covers_the_cases() -> None:
    """The workload really produces what the oracle is about (guards the generator)."""
    stats: Counter[str] = Counter()
    for seed in range(4, 8):
        stats.update(
            run_standalone(seed, _seeded_workload(seed), 1_500, snapshot_probability=0.004)
        )
    wanted = [
        "tree completed",
        "completed at the finish of the last task",
        "tree failed",
        "tree replayed",
        "tree failure: timed out",
        "tree failure: a task failed for good",
        "tree failure: a task was cancelled",
        "tree failure: anchored outside the tree",
        "tasks cancelled by their tree",
        "task retried",
        "unanchored children",
        "children with several anchors",
        "joins that waited for their anchors",
        "stale reports",
        "snapshot restores",
        "trees pending at a restore",
    ]
    assert_exercised(stats, wanted)
    assert stats["max completed tree size"] >= 100, dict(stats)


def test_tree_records_are_in_the_snapshot_and_the_digest() -> None:
    """The tracking state is replicated state: every field of a record changes the digest
    and survives a snapshot round trip (so replicas that differ in it are told apart)."""
    workload = Workload(
        random.Random(5), sizes=(200,), timeouts_ms=(MAX_TREE_TIMEOUT_MS,), fail_probability=0.0
    )
    machine = StateMachine()
    pending: list[TreeRecord] = []
    for _ in range(1_000):  # until a tree is pending with its deadline set, mid-growth
        machine.apply(workload.next_entry(machine, machine.now_ms))
        trees = machine.trees.values()
        pending = [t for t in trees if t.state == PENDING and t.deadline_ms is not None]
        if pending and len(machine.tree_live[pending[0].root]) > 5:
            break
    else:
        pytest.fail("no pending tree with five live tasks in 1,000 entries")
    data = machine.encode_snapshot()
    restored = StateMachine.from_snapshot(data)
    assert restored.trees == machine.trees and restored.digest() == machine.digest()
    changes = {
        "ack_val": pending[0].ack_val ^ 1,
        "attempt": pending[0].attempt + 1,
        "deadline_ms": (pending[0].deadline_ms or 0) + 1,
        "state": FAILED,
        "reason": "x",
        "ended_ms": 1,
        "timeout_ms": pending[0].timeout_ms + 1,
    }
    for name, value in changes.items():
        copy = StateMachine.from_snapshot(data)
        setattr(copy.trees[pending[0].root], name, value)
        assert copy.digest() != machine.digest(), name


@pytest.mark.parametrize("shape", list(Shape), ids=str)
def test_ten_thousand_task_tree(shape: Shape) -> None:
    """One tree of exactly 10,000 tasks completes at the finish of its last task (and not
    before: the oracle checks every entry), across a snapshot restore."""
    seed = sum(map(ord, shape.value))
    workload = Workload(
        random.Random(seed),
        roots=1,
        roots_at_once=1,
        sizes=(10_000,),
        exact_size=True,
        shapes=(shape,),
        fail_probability=0.0,
        cancel_probability=0.0,
        brittle_probability=0.0,
        unanchored_probability=0.01,
        timeouts_ms=(MAX_TREE_TIMEOUT_MS,),
        max_batch=1_000,
    )
    stats = stats_or_fail(
        lambda: run_standalone(
            seed,
            workload,
            60_000,
            snapshot_probability=0.0,
            stop_when_done=True,
            restore_at_size=5_000,
        )
    )
    assert stats["tree completed"] == 1, dict(stats)
    assert stats["max tree size"] == 10_000, dict(stats)
    assert stats["completed at the finish of the last task"] == 1
    assert stats["snapshot restores"] == 1 and stats["trees pending at a restore"] == 1


# --- the replicated run -------------------------------------------------------------------


class TreeEntryGenerator(EntryGenerator):
    """test_replicated.py's proposals, from the tree workload (ids from one counter that
    only grows, so entries built by successive leaders never reuse an id)."""

    def __init__(self, seed: int, view: StateMachine, workload: Workload | None = None) -> None:
        super().__init__(seed, view)
        rng = random.Random(seed ^ 0x7EE)
        self.workload = workload or Workload(
            rng,
            roots_at_once=rng.choice((2, 4, 8)),
            sizes=(1, 5, 30, 120),
            fail_probability=rng.choice((0.0, 0.02)),
            cancel_probability=rng.choice((0.0, 0.005)),
            timeouts_ms=(2_000, 600_000, MAX_TREE_TIMEOUT_MS),
            max_batch=16,
        )

    def next(self) -> tuple[e.Entry, Expect]:
        return self.workload.next_entry(self.view, self.now_ms), Expect()


class OracleReference(ReferenceMachine):
    """The replay of the committed log, checked entry by entry by the tree oracle."""

    def __init__(self) -> None:
        super().__init__()
        self.oracle = TreeOracle()

    def apply(self, entry: e.Entry) -> Applied:
        applied = super().apply(entry)
        self.oracle.observe(self, entry, applied.result, applied.trees_ended)
        return applied


class TreeSimulation(Simulation):
    def __init__(self, seed: int, steps: int, root: Path, workload: Workload | None = None) -> None:
        super().__init__(seed, steps, root)
        self.tree_generator = TreeEntryGenerator(seed, StateMachine(), workload)
        self.generator = self.tree_generator
        self.trees = OracleReference()
        self.reference = self.trees
        # Roots pending on the leader when it was changed or killed.
        self.in_flight: set[int] = set()

    def _note_in_flight(self) -> None:
        leader = self.by_name.get(self.elected or "")
        if leader is not None and leader.node is not None:
            pending = {r for r, t in leader.node.state.trees.items() if t.state == PENDING}
            self.in_flight |= pending
            self.stats["trees in flight at a leader change or kill"] += len(pending)

    async def act_clock_jump(self) -> None:
        # Short jumps: trees time out sometimes, finished tasks are not purged mid-tree.
        self.offset_ms += self.rng.choice((100, 1_000, 5_000))

    async def act_leader_change(self) -> None:
        self._note_in_flight()
        await super().act_leader_change()

    async def act_kill(self) -> None:
        self._note_in_flight()
        await super().act_kill()

    async def act_kill_leader_mid_write(self) -> None:
        self._note_in_flight()
        await super().act_kill_leader_mid_write()

    async def act_power_loss(self) -> None:
        self._note_in_flight()
        await super().act_power_loss()

    async def settle(self, *, final: bool) -> None:
        await super().settle(final=final)
        if final:
            await self._drain()

    async def _drain(self) -> None:
        """Let every tree end: the workload only assigns and finishes (no failures, trees
        grow to their planned size), on whichever leader is healthy, settling (all
        replicas compared) between rounds."""
        workload = self.tree_generator.workload
        workload.draining = True
        workload.max_batch = max(workload.max_batch, 256)  # fewer rounds
        oracle = self.trees.oracle
        for _ in range(MAX_DRAIN_ROUNDS):
            leader = self._healthy_leader()
            if leader is None or leader.node is None:
                fail("no healthy leader right after settling: " + self._describe())
            if not oracle.trees and not any(
                t.state == PENDING for t in leader.node.state.trees.values()
            ):
                break
            workload.reported.clear()  # everything reported is applied by now, or lost
            for _ in range(DRAIN_PROPOSALS_PER_ROUND):
                # One at a time: each sees the previous one applied (a chain grows a
                # level per assign and finish).
                self.propose(leader)
                await self._wait_for("proposals to finish", lambda: not self.proposal_tasks)
            await super().settle(final=False)
        else:
            fail(f"trees {sorted(oracle.trees)[:10]} still pending after {MAX_DRAIN_ROUNDS} rounds")
        lost = sorted(r for r in self.in_flight if r not in oracle.ended)
        if lost:
            fail(f"trees in flight at a leader change never ended: {lost[:10]}")
        self.stats["in-flight trees completed on a later leader"] = sum(
            oracle.ended[r] == COMPLETED for r in self.in_flight
        )
        self.stats.update(oracle.stats)


def run_replicated(
    seed: int, root: Path, steps: int, workload: Workload | None = None
) -> Counter[str]:
    return run_seed(
        lambda: TreeSimulation(seed, steps, root, workload),
        seed,
        steps,
        name="replicated tree simulation",
        reproduce="tests/sim/test_trees_sim.py -k leader",
        final="in the final check or drain",
        expected=AssertionError,
    )


@pytest.mark.parametrize("seed", seeds(DEFAULT_REPLICATED_SEEDS), ids=lambda s: f"seed={s}")
def test_trees_across_leader_changes(seed: int, tmp_path: Path) -> None:
    stats = stats_or_fail(lambda: run_replicated(seed, tmp_path, steps(DEFAULT_STEPS)))
    assert stats["roots"] > 0 and stats["tree completed"] > 0, dict(stats)


def test_trees_across_leader_changes_cover_the_faults(tmp_path: Path) -> None:
    """Trees really were in flight at leader changes and kills, and completed later."""
    stats: Counter[str] = Counter()
    for seed in range(3):
        stats.update(run_replicated(100 + seed, tmp_path / str(seed), DEFAULT_STEPS))
    wanted = [
        "take-overs",
        "kills",
        "snapshots",
        "trees in flight at a leader change or kill",
        "in-flight trees completed on a later leader",
        "tree replayed",
        "completed at the finish of the last task",
    ]
    assert_exercised(stats, wanted)


def test_ten_thousand_task_trees_across_leader_changes(tmp_path: Path) -> None:
    """Trees of up to 10,000 tasks (DAG and mixed shapes) grow while leaders change,
    replicas are killed and snapshots taken; each completes exactly at the finish of its
    last task (the oracle checks every committed entry), and the replicas agree."""
    seed = 10_000
    workload = Workload(
        random.Random(seed),
        roots=2,
        roots_at_once=2,
        sizes=(10_000,),
        exact_size=True,
        shapes=(Shape.DAG, Shape.MIXED),
        fail_probability=0.0,
        cancel_probability=0.0,
        brittle_probability=0.0,
        timeouts_ms=(MAX_TREE_TIMEOUT_MS,),
        max_batch=400,
    )
    stats = stats_or_fail(lambda: run_replicated(seed, tmp_path, DEFAULT_STEPS, workload))
    # A submission a killed leader never made durable is lost (the client would retry).
    roots = stats["roots"]
    assert 1 <= roots <= 2 and stats["tree completed"] == roots, dict(stats)
    # The workload plans from the leader's view, which may be stale (a proposal built
    # before the previous one is applied): a child it counted may never be created.
    assert stats["max completed tree size"] >= 9_000, dict(stats)
    assert stats["in-flight trees completed on a later leader"] == roots, dict(stats)
