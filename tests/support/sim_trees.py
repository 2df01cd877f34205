"""The task-tree simulation's oracle and workload (tests/sim/test_trees_sim.py): an exact
model of every tree (live tasks, ack value, status, deadline) fed from the entries, and
a seeded workload growing chains, fan-outs and DAGs, failing, cancelling and timing out.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from broker.core import (
    MAX_TREE_TIMEOUT_MS,
    ApplyResult,
    Rejected,
    StateMachine,
    TaskRef,
    TreeState,
    WorkerState,
    tree_value,
)
from broker.core import entries as e
from tests.support.sim_common import fail
from tests.support.sim_model import CANCELLED, ERROR, FINISHED, RUNNING, WAITING

TENANT: Final = "t"
WORKER: Final = "tree-worker"
FULL_CHECK_EVERY: Final = 200  # entries between exact comparisons of every tree
INVARIANTS_EVERY: Final = 500  # entries between check_invariants() (O(tasks))
DIGEST_EVERY: Final = 50  # entries between digest comparisons with the snapshot twin
MAX_DRAIN_ROUNDS: Final = 400
DRAIN_PROPOSALS_PER_ROUND: Final = 8
REPORT_MEMORY_ENTRIES: Final = 32  # entries after which a report may have been lost

PENDING: Final = TreeState.PENDING.value
COMPLETED: Final = TreeState.COMPLETED.value
FAILED: Final = TreeState.FAILED.value


# --- the oracle ---------------------------------------------------------------------------


@dataclass
class ModelTree:
    root: int
    timeout_ms: int
    status: str = PENDING
    attempt: int = 1
    outstanding: set[int] = field(default_factory=set)
    ack_val: int = 0  # XOR of tree_value over outstanding, kept as the model goes
    deadline_ms: int | None = None
    created: int = 1  # tasks created in the current run
    dirty: bool = False  # changed by the current entry


class TreeOracle:
    """What each tracked tree must look like, from entries and their results alone.

    Task states are modelled for tree tasks only; an untracked task is one the model
    never saw created in a tree (``task_root`` has no entry for it).
    """

    def __init__(self) -> None:
        self.now_ms = 0
        self.trees: dict[int, ModelTree] = {}  # roots not ended for good
        self.ended: dict[int, str] = {}  # root -> completed | failed
        self.task_root: dict[int, int] = {}
        self.state: dict[int, str] = {}
        self.attempts: dict[int, int] = {}
        self.max_attempts: dict[int, int] = {}
        self.stats: Counter[str] = Counter()
        self.entries = 0
        self._ended_now: list[int] = []
        self._touched: set[int] = set()
        # Joins: a child's anchors other than its parent; it may run once all finished.
        self.joins: dict[int, tuple[int, ...]] = {}

    # --- model transitions ---------------------------------------------------------

    def _set(self, task_id: int, state: str) -> None:
        self.state[task_id] = state
        self._touched.add(task_id)

    def _create(self, spec: e.TaskSpec, root: int) -> None:
        self.task_root[spec.id] = root
        self._set(spec.id, WAITING)
        self.attempts[spec.id] = 0
        self.max_attempts[spec.id] = spec.max_attempts

    def _end(self, tree: ModelTree, status: str) -> None:
        tree.status = status
        tree.dirty = True
        self.ended[tree.root] = status
        self._ended_now.append(tree.root)
        self.stats[f"tree {status}"] += 1

    def _fail(self, tree: ModelTree, reason: str) -> None:
        root = tree.root
        self.stats[f"tree failure: {reason}"] += 1
        tree.dirty = True
        for task_id in sorted(tree.outstanding):
            if task_id != root and self.state[task_id] in (WAITING, RUNNING):
                self._set(task_id, CANCELLED)
                self.stats["tasks cancelled by their tree"] += 1
        root_state = self.state[root]
        replayable = (
            root_state not in (ERROR, CANCELLED) and self.attempts[root] < self.max_attempts[root]
        )
        tree.deadline_ms = None
        if not replayable:
            if root_state in (WAITING, RUNNING):
                self._set(root, CANCELLED)
            tree.outstanding.clear()
            self._end(tree, FAILED)
            return
        self._set(root, WAITING)
        tree.outstanding = {root}
        tree.ack_val = tree_value(root)
        tree.attempt += 1
        tree.created = 1
        self.stats["tree replayed"] += 1

    def _tree_of(self, task_id: int) -> ModelTree | None:
        root = self.task_root.get(task_id)
        return self.trees.get(root) if root is not None else None

    def _fire_timers(self) -> None:
        due = sorted(
            (t.deadline_ms, t.root)
            for t in self.trees.values()
            if t.deadline_ms is not None and t.deadline_ms <= self.now_ms
        )
        for due_ms, root in due:
            tree = self.trees[root]
            if tree.status == PENDING and tree.deadline_ms == due_ms:
                self._fail(tree, "timed out")

    def _submit(self, entry: e.SubmitTasks, result: ApplyResult) -> None:
        if not isinstance(result, list):
            fail(f"submit answered {result!r}")
        for spec, answer in zip(entry.tasks, result, strict=True):
            if spec.track_tree and isinstance(answer, TaskRef):
                tree = ModelTree(spec.id, spec.tree_timeout_ms, outstanding={spec.id})
                tree.ack_val = tree_value(spec.id)
                tree.dirty = True
                self.trees[spec.id] = tree
                self._create(spec, spec.id)
                self.stats["roots"] += 1

    def _assign(self, entry: e.AssignTasks, result: ApplyResult) -> None:
        if not isinstance(result, list):
            fail(f"assign answered {result!r}")
        for assignment, answer in zip(entry.assignments, result, strict=True):
            task_id = assignment.task_id
            if task_id not in self.task_root:
                continue
            expected = self.state.get(task_id) == WAITING
            if isinstance(answer, TaskRef) != expected:
                fail(f"assignment of tree task {task_id} ({self.state.get(task_id)}): {answer}")
            if not expected:
                continue
            self._set(task_id, RUNNING)
            self.attempts[task_id] += 1
            tree = self._tree_of(task_id)
            if tree is None:
                fail(f"tree task {task_id} waiting, but its tree has ended")
            if task_id == tree.root and tree.deadline_ms is None:
                tree.deadline_ms = self.now_ms + tree.timeout_ms  # once per run
                tree.dirty = True

    def _finish(self, entry: e.FinishTasks, result: ApplyResult) -> None:
        if not isinstance(result, list):
            fail(f"finish answered {result!r}")
        for outcome, answer in zip(entry.outcomes, result, strict=True):
            task_id = outcome.task_id
            tree = self._tree_of(task_id)
            if task_id not in self.task_root:
                continue  # untracked: so are all its children
            running = (
                self.state.get(task_id) == RUNNING
                and self.attempts[task_id] == outcome.attempt
                and outcome.worker_id == WORKER
            )
            if isinstance(answer, Rejected) == running:
                fail(f"finish of tree task {task_id} ({self.state.get(task_id)}): {answer}")
            if not running:
                self.stats["stale reports"] += 1
                continue
            if tree is None or tree.status != PENDING:
                fail(f"tree task {task_id} was running in a tree that is not pending")
            if not outcome.ok:
                if self.attempts[task_id] >= self.max_attempts[task_id]:
                    self._set(task_id, ERROR)
                    self._fail(tree, "a task failed for good")
                else:
                    self._set(task_id, WAITING)
                    self.stats["task retried"] += 1
                continue
            self._set(task_id, FINISHED)
            self._finished_ok(tree, task_id, outcome.spawn)

    def _finished_ok(self, tree: ModelTree, task_id: int, spawn: tuple[e.Spawn, ...]) -> None:
        tree.dirty = True
        tree.outstanding.remove(task_id)
        tree.ack_val ^= tree_value(task_id)
        failed = False
        for child in spawn:
            if not child.anchors:
                self.stats["unanchored children"] += 1
                continue
            if failed:
                continue
            if any(self.task_root.get(a) != tree.root for a in child.anchors):
                failed = True
                continue
            self._create(child.task, tree.root)
            join = tuple(a for a in child.anchors if a != task_id)
            if join:
                self.joins[child.task.id] = join
                if any(self.state.get(a) != FINISHED for a in join):
                    self.stats["joins that waited for their anchors"] += 1
            tree.outstanding.add(child.task.id)
            tree.ack_val ^= tree_value(child.task.id)
            tree.created += 1
            self.stats["max tree size"] = max(self.stats["max tree size"], tree.created)
            if len(child.anchors) > 1:
                self.stats["children with several anchors"] += 1
        if failed:
            self._fail(tree, "anchored outside the tree")
        elif not tree.outstanding:
            self.stats["completed at the finish of the last task"] += 1
            self.stats["max completed tree size"] = max(
                self.stats["max completed tree size"], tree.created
            )
            self._end(tree, COMPLETED)

    def _cancel(self, entry: e.CancelTask, result: ApplyResult) -> None:
        task_id = entry.task_id
        if task_id not in self.task_root:
            return
        live = self.state.get(task_id) in (WAITING, RUNNING)
        if isinstance(result, TaskRef) != live:
            fail(f"cancel of tree task {task_id} ({self.state.get(task_id)}): {result!r}")
        if not live:
            return
        self._set(task_id, CANCELLED)
        tree = self._tree_of(task_id)
        if tree is None or tree.status != PENDING:
            fail(f"tree task {task_id} was live in a tree that is not pending")
        self._fail(tree, "a task was cancelled")

    # --- per entry ---------------------------------------------------------------------

    def observe(
        self, machine: StateMachine, entry: e.Entry, result: ApplyResult, ended: list[int]
    ) -> None:
        """Advance the model by one applied entry, then compare with ``machine``."""
        self.entries += 1
        self._ended_now = []
        self._touched = set()
        self.now_ms = max(self.now_ms, entry.time_ms)
        self._fire_timers()
        if isinstance(entry, e.SubmitTasks):
            self._submit(entry, result)
        elif isinstance(entry, e.AssignTasks):
            self._assign(entry, result)
        elif isinstance(entry, e.FinishTasks):
            self._finish(entry, result)
        elif isinstance(entry, e.CancelTask):
            self._cancel(entry, result)
        if ended != self._ended_now:
            fail(f"trees ended by this entry: {ended}, the oracle expected {self._ended_now}")
        self._compare(machine, full=self.entries % FULL_CHECK_EVERY == 0)
        for root in self._ended_now:
            del self.trees[root]

    def _compare(self, machine: StateMachine, *, full: bool) -> None:
        for task_id in self._touched:
            task = machine.tasks.get(task_id)
            if task is None or task.state != self.state[task_id]:
                actual = None if task is None else task.state
                fail(f"tree task {task_id} is {actual}, the oracle expected {self.state[task_id]}")
        for task_id, join in list(self.joins.items()):
            # A waiting join is queued exactly when every anchor finished.
            if self.state.get(task_id) != WAITING:
                if self.state.get(task_id) != RUNNING:
                    del self.joins[task_id]
                continue
            blocked = any(self.state.get(a) != FINISHED for a in join)
            queued = task_id in machine.waiting.get(TENANT, {})
            if queued == blocked:
                fail(f"join {task_id} queued {queued}, its anchors {join} blocked {blocked}")
        for tree in self.trees.values():
            if not (tree.dirty or full):
                continue
            tree.dirty = False
            record = machine.trees.get(tree.root)
            if record is None:
                fail(f"tree {tree.root} has no record")
            if record.state != tree.status:
                fail(
                    f"tree {tree.root} is {record.state}, the oracle expected {tree.status} "
                    f"({len(tree.outstanding)} tasks outstanding)"
                )
            if tree.status != PENDING:
                continue
            live = machine.tree_live.get(tree.root, set())
            if (
                record.attempt != tree.attempt
                or record.ack_val != tree.ack_val
                or record.deadline_ms != tree.deadline_ms
                or len(live) != len(tree.outstanding)
            ):
                fail(
                    f"tree {tree.root}: attempt {record.attempt} deadline {record.deadline_ms} "
                    f"live {len(live)}, the oracle expected attempt {tree.attempt} deadline "
                    f"{tree.deadline_ms} outstanding {len(tree.outstanding)} (or ack val differs)"
                )
            if full and live != tree.outstanding:
                fail(f"tree {tree.root}: live {sorted(live ^ tree.outstanding)[:10]} differ")
        if full:
            for task_id, state in self.state.items():
                task = machine.tasks.get(task_id)
                if task is not None and task.state != state:
                    fail(f"tree task {task_id} is {task.state}, the oracle expected {state}")

    def pending_roots(self) -> set[int]:
        return set(self.trees)


# --- the workload -------------------------------------------------------------------------


class Shape(StrEnum):
    CHAIN = "chain"  # each task spawns one child: depth = size
    FANOUT = "fanout"  # many children per task
    DAG = "dag"  # children anchored to the parent and to other live tasks of the tree
    MIXED = "mixed"  # one of the above at each finish


@dataclass
class Plan:
    shape: Shape
    target: int  # tasks to create in each run
    width: int
    brittle: bool  # some of its children anchor outside the tree
    attempt: int = 1
    created: int = 1


@dataclass
class Workload:
    """Entries that grow random trees, from ``rng`` and a read-only ``view``."""

    rng: random.Random
    roots: int = 10**9  # tracked roots to submit in all
    roots_at_once: int = 4
    sizes: tuple[int, ...] = (1, 5, 40, 300)
    shapes: tuple[Shape, ...] = tuple(Shape)
    fail_probability: float = 0.03
    cancel_probability: float = 0.01
    brittle_probability: float = 0.1  # of a tree, whose children then anchor outside it
    unanchored_probability: float = 0.05
    exact_size: bool = False  # each run creates exactly the size drawn (else half to all)
    timeouts_ms: tuple[int, ...] = (3_000, 60_000, MAX_TREE_TIMEOUT_MS)
    max_batch: int = 32
    draining: bool = False  # no new roots, failures, cancels or bad anchors: let trees end
    now_ms: int = 1_700_000_000_000
    next_id: int = 0
    submitted: int = 0
    plans: dict[int, Plan] = field(default_factory=dict)
    plain: list[int] = field(default_factory=list)  # untracked tasks, for outside anchors
    # Attempts reported finished lately (-> the view's entries_applied then): a proposal
    # built before the previous one is applied must not report them again (its children
    # would be counted twice). A report may be lost (a leader killed before it was
    # durable): forgotten after a while, and when the view changes (another leader).
    reported: dict[tuple[int, int], int] = field(default_factory=dict)
    reported_view: int = 0

    def _new_id(self, view: StateMachine) -> int:
        self.next_id = max(self.next_id, view.max_task_id) + 1
        return self.next_id

    def _time(self, now_ms: int) -> int:
        rng = self.rng
        r = rng.random()
        step = 0 if r < 0.3 else rng.randint(1, 100) if r < 0.97 else rng.randint(1_000, 20_000)
        self.now_ms = max(self.now_ms, now_ms) + step
        return self.now_ms

    def next_entry(self, view: StateMachine, now_ms: int) -> e.Entry:
        time_ms = self._time(now_ms)
        worker = view.workers.get(WORKER)
        if worker is None or worker.state != WorkerState.CONNECTED:
            return e.RegisterWorker(time_ms=time_ms, worker_id=WORKER, task_types={"*": 10**6})
        for root in [r for r in self.plans if (t := view.trees.get(r)) and t.state != PENDING]:
            del self.plans[root]
        rng = self.rng
        if id(view) != self.reported_view:
            self.reported_view = id(view)
            self.reported.clear()
        waiting = view.waiting.get(TENANT, {})
        tasks = view.tasks
        horizon = view.entries_applied - REPORT_MEMORY_ENTRIES
        if len(self.reported) > 4 * 1024:
            self.reported = {k: at for k, at in self.reported.items() if at > horizon}
        running = [
            t
            for t in sorted(view.by_state[RUNNING])
            if self.reported.get((t, tasks[t].attempt), horizon) <= horizon
        ]
        choices: list[tuple[str, float]] = []
        if not self.draining and self.submitted < self.roots:
            choices.append(("submit", 6 if len(self.plans) < self.roots_at_once else 0.3))
        if waiting:
            choices.append(("assign", 10))
        if running:
            choices.append(("finish", 12))
        if not self.draining and self.plans:
            choices.append(("cancel", 20 * self.cancel_probability))
        choices.append(("tick", 0.5))
        kind = rng.choices([k for k, _ in choices], [w for _, w in choices])[0]
        if kind == "submit":
            return self._submit(view, time_ms)
        if kind == "assign":
            batch = rng.randint(1, self.max_batch)
            ids = list(waiting)[: batch * 2]
            picked = sorted(rng.sample(ids, min(batch, len(ids))))
            return e.AssignTasks(
                time_ms=time_ms, assignments=tuple(e.Assignment(i, WORKER) for i in picked)
            )
        if kind == "finish":
            return self._finish(view, time_ms, running)
        if kind == "cancel":
            root = rng.choice(sorted(self.plans))
            live = sorted(view.tree_live.get(root, ()))
            if live:
                return e.CancelTask(time_ms=time_ms, task_id=rng.choice(live))
        return e.Tick(time_ms=time_ms)

    def _submit(self, view: StateMachine, time_ms: int) -> e.Entry:
        rng = self.rng
        specs: list[e.TaskSpec] = []
        for _ in range(min(rng.choice((1, 1, 2)), self.roots - self.submitted)):
            task_id = self._new_id(view)
            if rng.random() < 0.15:  # a plain task now and then
                specs.append(e.TaskSpec(id=task_id, type="plain", tenant=TENANT))
                self.plain.append(task_id)
                continue
            specs.append(
                e.TaskSpec(
                    id=task_id,
                    type="root",
                    tenant=TENANT,
                    max_attempts=rng.randint(1, 3),
                    track_tree=True,
                    tree_timeout_ms=rng.choice(self.timeouts_ms),
                )
            )
            size = rng.choice(self.sizes)
            target = size if self.exact_size else rng.randint(max(1, size // 2), size)
            self.plans[task_id] = Plan(
                rng.choice(self.shapes),
                target,
                rng.randint(2, 60),
                brittle=rng.random() < self.brittle_probability,
            )
            self.submitted += 1
        return e.SubmitTasks(time_ms=time_ms, tasks=tuple(specs))

    def _finish(self, view: StateMachine, time_ms: int, running: list[int]) -> e.Entry:
        rng = self.rng
        batch = rng.randint(1, self.max_batch)
        picked = sorted(rng.sample(running, min(batch, len(running))))
        outcomes: list[e.TaskOutcome] = []
        live: dict[int, tuple[int, ...]] = {}  # live tasks per tree, read once per entry
        for task_id in picked:
            task = view.tasks[task_id]
            ok = self.draining or rng.random() >= self.fail_probability
            attempt = task.attempt
            stale = rng.random() < 0.01
            if stale:
                attempt -= 1  # a late report of an earlier attempt: creates nothing
            else:
                self.reported[(task_id, attempt)] = view.entries_applied
            spawn = self._spawn(view, task_id, task.root, live) if ok and not stale else ()
            outcomes.append(
                e.TaskOutcome(
                    task_id=task_id,
                    worker_id=task.worker or "",
                    attempt=attempt,
                    ok=ok,
                    result=b"1" if ok else None,
                    error=None if ok else "boom",
                    spawn=spawn,
                )
            )
        return e.FinishTasks(time_ms=time_ms, outcomes=tuple(outcomes))

    def _spawn(
        self, view: StateMachine, task_id: int, root: int | None, live: dict[int, tuple[int, ...]]
    ) -> tuple[e.Spawn, ...]:
        plan = self.plans.get(root) if root is not None else None
        tree = view.trees.get(root) if root is not None else None
        if plan is None or tree is None:
            return ()
        rng = self.rng
        if tree.attempt != plan.attempt:  # replayed: the tree grows again from its root
            plan.attempt, plan.created = tree.attempt, 1
        shape = (
            rng.choice((Shape.CHAIN, Shape.FANOUT, Shape.DAG))
            if plan.shape == Shape.MIXED
            else plan.shape
        )
        if shape == Shape.CHAIN:
            count = 1
        elif shape == Shape.FANOUT:
            count = plan.width if task_id == root else rng.randint(0, plan.width)
        else:
            count = rng.randint(1, 3)
        count = min(count, plan.target - plan.created)
        others: tuple[int, ...] = ()
        if shape == Shape.DAG and root is not None:
            if root not in live:
                live[root] = tuple(view.tree_live.get(root, ()))
            others = live[root]
        anchor_sets: list[tuple[int, ...]] = []
        for _ in range(count):
            anchors: tuple[int, ...] = (task_id,)
            if others and rng.random() < 0.5:
                other = rng.choice(others)
                # Several parents; or hung only from another live task of the tree.
                anchors = (task_id, other) if rng.random() < 0.7 and other != task_id else (other,)
            if plan.brittle and not self.draining and rng.random() < 0.02:
                outside = rng.choice(self.plain) if self.plain else 10**12
                anchors = (*anchors, outside)
            anchor_sets.append(anchors)
        plan.created += count
        if rng.random() < self.unanchored_probability:
            anchor_sets.insert(rng.randint(0, len(anchor_sets)), ())  # untracked
        # Ids in order: the leader stamps increasing ids on a finish's children.
        children = [
            e.Spawn(
                e.TaskSpec(
                    id=self._new_id(view),
                    type="child" if anchors else "free",
                    tenant=TENANT,
                    max_attempts=rng.randint(1, 3),
                ),
                anchors,
            )
            for anchors in anchor_sets
        ]
        return tuple(children)
