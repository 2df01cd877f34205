"""Task trees: the tracker's memory per live root, for trees of 1 and of 1,000 tasks.

The tracker is the state machine's ``trees`` dict (root id -> ``TreeRecord``, Storm's
acker entry: root, tenant, ack val, timeout, deadline, attempt, state, reason, end).
Its memory is a deep size: ``sys.getsizeof`` of the dict and of every object reachable
from it (keys, records, their field values), each distinct object counted once (shared
ones, like the tenant string or ``None``, once in all). Task objects are not counted.
As a cross-check, the tracker is also rebuilt the way a snapshot load builds it
(msgpack-decoded records put in a dict) under ``tracemalloc``.

Scenarios, all on one ``StateMachine`` each, driven with the entries the leader logs,
encoded and decoded as a node applies them (``SubmitTasks``, ``AssignTasks``,
``FinishTasks`` with ``Spawn`` children; retention 1 ms so that finished children are
purged as they would be after their retention):

1. ``1 task``: ``--roots`` tracked roots submitted and started (running): each tree is
   its root alone, pending.
2. ``1,000 tasks, real path``: ``--real-roots`` roots whose trees grow, entirely through
   ``apply``, as chains: each task's successful finish spawns the next one anchored to
   it, until ``--tasks-per-tree`` tasks were created; the last one runs, so every tree
   is pending. Every one of the tree's tasks was a real ``Task`` that the tracker acked.
3. ``1,000 tasks``: ``--roots`` roots at the same scale as 1. Creating 100 million task
   objects through ``apply`` is out of reach here (~10-80 us each: hours on this
   machine), so: the roots are submitted, started and finished through ``apply``, each
   finish spawning its first child (a real task, anchored to the root) and that child is
   started; then each tree's remaining ``--tasks-per-tree`` - 2 tasks are driven through
   the tracker's per-root update alone, without task objects: for each further chain
   step, the live task finishes and spawns the next one, and the root's real
   ``TreeRecord`` gets exactly the update ``StateMachine._finished_ok`` makes for such a
   finish, ``ack_val ^= tree_value(finished_id) ^ tree_value(child_id)``, with child ids
   taken from ``max_task_id`` as the leader stamps them. The records stay pending (the
   ack val is never 0). Scenario 2 shows the real path yields the same per-root size.

The per-root figure of 1 and 3 is then compared. ``tree_live`` (live task ids per tree,
an index rebuilt from the tasks, not replicated state) grows with a tree's live tasks,
like the other task indexes; it is printed per root for information (one live task per
tree in every scenario here).

Optional: the throughput of tree ack processing through ``apply`` (chain steps, i.e.
assign + successful finish spawning one child), tracked vs the same untracked.

    python bench/bench_trees.py
    python bench/bench_trees.py --roots 100000 --tasks-per-tree 1000 --real-roots 1000
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Iterable
from typing import Any

import msgspec

from broker.core import MAX_TREE_TIMEOUT_MS, StateMachine, TreeRecord, TreeState, tree_value
from broker.core import entries as e

T0_MS = 1_700_000_000_000
BATCH = 1_000
TENANT = "tenant-a"
WORKER = "w1"


def deep_size(objects: Iterable[Any], seen: set[int]) -> int:
    """Bytes of the objects not counted yet (by identity), shallow each."""
    total = 0
    for obj in objects:
        if id(obj) not in seen:
            seen.add(id(obj))
            total += sys.getsizeof(obj)
    return total


def tracker_bytes(trees: dict[int, TreeRecord]) -> int:
    seen: set[int] = set()
    total = deep_size([trees], seen)
    fields = TreeRecord.__struct_fields__
    for root, record in trees.items():
        total += deep_size([root, record], seen)
        total += deep_size((getattr(record, name) for name in fields), seen)
    return total


def tree_live_bytes(machine: StateMachine) -> int:
    seen: set[int] = set()
    total = deep_size([machine.tree_live], seen)
    for root, live in machine.tree_live.items():
        total += deep_size([root, live], seen)
    return total


def traced_snapshot_load_bytes(trees: dict[int, TreeRecord]) -> int:
    """tracemalloc of the tracker as StateMachine.from_snapshot rebuilds it."""
    data = msgspec.msgpack.encode(list(trees.values()))
    decoder = msgspec.msgpack.Decoder(list[TreeRecord])
    gc.collect()
    tracemalloc.start()
    try:
        records = decoder.decode(data)
        rebuilt = {t.root: t for t in records}
        del records  # the snapshot body's list is dropped after the load
        traced, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rebuilt) == len(trees)
    return traced


class Driver:
    """A StateMachine fed with the entries the leader would log."""

    def __init__(self, *, track: bool = True) -> None:
        self.m = StateMachine()
        self.now_ms = T0_MS
        self.track = track
        self.last_id = 0
        self.apply(e.SetConfig(time_ms=self.now_ms, finished_task_retention_ms=1))
        self.apply(e.RegisterWorker(time_ms=self.now_ms, worker_id=WORKER, task_types={"*": 10**6}))

    def apply(self, entry: e.Entry) -> Any:
        # As a node applies it: decoded from the log (strings are not shared with others).
        return self.m.apply(e.decode_entry(e.encode_entry(entry))).result

    def next_id(self) -> int:
        self.last_id = max(self.last_id, self.m.max_task_id) + 1
        return self.last_id

    def submit_roots(self, count: int) -> list[int]:
        roots: list[int] = []
        for start in range(0, count, BATCH):
            specs = []
            for _ in range(min(BATCH, count - start)):
                task_id = self.next_id()
                specs.append(
                    e.TaskSpec(
                        id=task_id,
                        type="step",
                        tenant=TENANT,
                        track_tree=self.track,
                        tree_timeout_ms=MAX_TREE_TIMEOUT_MS,
                    )
                )
                roots.append(task_id)
            self.apply(e.SubmitTasks(time_ms=self.now_ms, tasks=tuple(specs)))
        return roots

    def start(self, task_ids: list[int]) -> None:
        for start in range(0, len(task_ids), BATCH):
            batch = task_ids[start : start + BATCH]
            assignments = tuple(e.Assignment(t, WORKER) for t in batch)
            results = self.apply(e.AssignTasks(time_ms=self.now_ms, assignments=assignments))
            assert all(r.state == "running" for r in results), results[:3]

    def finish_spawning(self, task_ids: list[int]) -> list[int]:
        """Each task finishes ok and spawns one child anchored to it; the children."""
        children: list[int] = []
        for start in range(0, len(task_ids), BATCH):
            outcomes = []
            for task_id in task_ids[start : start + BATCH]:
                child = self.next_id()
                children.append(child)
                spec = e.TaskSpec(id=child, type="step", tenant=TENANT)
                anchors = (task_id,) if self.track else ()
                outcomes.append(
                    e.TaskOutcome(
                        task_id=task_id,
                        worker_id=WORKER,
                        attempt=1,
                        ok=True,
                        spawn=(e.Spawn(spec, anchors),),
                    )
                )
            results = self.apply(e.FinishTasks(time_ms=self.now_ms, outcomes=tuple(outcomes)))
            assert all(r.state == "finished" for r in results), results[:3]
        return children

    def chain_step(self, live: list[int]) -> list[int]:
        """One level of every chain: the live tasks run, finish and spawn the next."""
        self.now_ms += 2  # past the 1 ms retention: the previous level is purged
        self.start(live)
        return self.finish_spawning(live)


def check_pending(machine: StateMachine, roots: list[int]) -> None:
    pending = TreeState.PENDING.value
    assert all(machine.trees[r].state == pending for r in roots), "a tree is not pending"


def report(name: str, machine: StateMachine, roots: int, seconds: float) -> tuple[float, float]:
    """Print the tracker's size; (bytes per root, bytes per record without the dict table)."""
    gc.collect()
    assert len(machine.trees) == roots, (len(machine.trees), roots)
    total = tracker_bytes(machine.trees)
    table = sys.getsizeof(machine.trees)
    traced = traced_snapshot_load_bytes(machine.trees)
    live = tree_live_bytes(machine)
    print(
        f"{name:<32} {roots:>8,} roots: tracker {total / 2**20:7.2f} MiB = {total / roots:5.1f} "
        f"B/root ({table / roots:4.1f} dict table + {(total - table) / roots:5.1f} key and "
        f"record); as loaded from a snapshot (tracemalloc) {traced / roots:5.1f} B/root; "
        f"tree_live index {live / roots:5.1f} B/root; {len(machine.tasks):,} task objects "
        f"(not counted); built in {seconds:.1f} s",
        flush=True,
    )
    return total / roots, (total - table) / roots


def one_task_trees(roots: int) -> tuple[Driver, float]:
    started = time.perf_counter()
    driver = Driver()
    ids = driver.submit_roots(roots)
    driver.start(ids)
    check_pending(driver.m, ids)
    assert all(driver.m.tasks[r].root == r for r in ids[:10])
    return driver, time.perf_counter() - started


def real_chains(
    roots: int, tasks_per_tree: int, *, track: bool = True
) -> tuple[Driver, float, float]:
    """Chains grown through apply alone; returns the driver and the wall and CPU time of
    the chain steps (assign + finish spawning a child), tasks_per_tree - 1 per root."""
    driver = Driver(track=track)
    ids = driver.submit_roots(roots)
    started, started_cpu = time.perf_counter(), time.process_time()
    live = ids
    for _ in range(tasks_per_tree - 1):
        live = driver.chain_step(live)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    driver.now_ms += 2
    driver.start(live)  # the last task of each tree runs: the trees are pending
    if track:
        check_pending(driver.m, ids)
        created = driver.m.max_task_id
        assert created == roots * tasks_per_tree, created
    return driver, seconds, cpu_seconds


def driven_chains(roots: int, tasks_per_tree: int) -> tuple[Driver, float]:
    started = time.perf_counter()
    driver = Driver()
    ids = driver.submit_roots(roots)
    live = driver.chain_step(ids)  # real: roots run, finish, spawn their first child
    driver.now_ms += 2
    driver.start(live)  # the first child runs (a real task)
    machine = driver.m
    trees = machine.trees
    # The rest of each chain through the tracker's per-root update alone (see the
    # docstring): the live task finishes, spawning the next; no task objects.
    next_id = machine.max_task_id
    for root, live_id in zip(ids, live, strict=True):
        record = trees[root]
        current = live_id
        for _ in range(tasks_per_tree - 2):
            next_id += 1
            record.ack_val ^= tree_value(current) ^ tree_value(next_id)
            current = next_id
        assert record.ack_val == tree_value(current)  # pending: only the last one live
    machine.max_task_id = next_id  # the ids the leader stamped are used up
    check_pending(machine, ids)
    return driver, time.perf_counter() - started


def memory(args: argparse.Namespace) -> None:
    driver, seconds = one_task_trees(args.roots)
    small, _ = report("trees of 1 task", driver.m, args.roots, seconds)
    del driver
    gc.collect()
    driver, seconds = driven_chains(args.roots, args.tasks_per_tree)
    name = f"trees of {args.tasks_per_tree:,} tasks (driven)"
    big, _ = report(name, driver.m, args.roots, seconds)
    del driver
    gc.collect()
    print(
        f"per root: {small:.1f} B (1 task) vs {big:.1f} B ({args.tasks_per_tree:,} tasks), "
        f"difference {big - small:+.1f} B",
        flush=True,
    )
    if args.real_roots:
        driver, seconds = one_task_trees(args.real_roots)
        _, small_record = report("trees of 1 task", driver.m, args.real_roots, seconds)
        del driver
        driver, seconds, _ = real_chains(args.real_roots, args.tasks_per_tree)
        name = f"trees of {args.tasks_per_tree:,} tasks (real path)"
        _, real_record = report(name, driver.m, args.real_roots, seconds)
        del driver
        gc.collect()
        print(
            f"per record at {args.real_roots:,} roots: {small_record:.1f} B (1 task) vs "
            f"{real_record:.1f} B ({args.tasks_per_tree:,} tasks through apply), "
            f"difference {real_record - small_record:+.1f} B",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--roots", type=int, default=100_000)
    parser.add_argument("--tasks-per-tree", type=int, default=1_000)
    parser.add_argument("--real-roots", type=int, default=1_000, help="roots of scenario 2")
    parser.add_argument(
        "--throughput-roots", type=int, default=1_000, help="0: skip the throughput part"
    )
    parser.add_argument("--throughput-steps", type=int, default=50)
    parser.add_argument("--throughput-repeats", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true", help="throughput part only")
    args = parser.parse_args()
    if args.tasks_per_tree < 2:
        parser.error("--tasks-per-tree must be at least 2")
    print(
        f"# Python {platform.python_version()} on {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} cores; load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if not args.skip_memory:
        memory(args)
    if args.throughput_roots:
        roots, steps = args.throughput_roots, args.throughput_steps
        finishes = roots * steps
        best: dict[bool, float] = {}
        for repeat in range(args.throughput_repeats):
            for track in (True, False):  # alternated: load changes hit both alike
                gc.collect()
                _driver, seconds, cpu_seconds = real_chains(roots, steps + 1, track=track)
                rate = finishes / cpu_seconds
                best[track] = max(best.get(track, 0.0), rate)
                print(
                    f"run {repeat + 1}: chain steps through apply "
                    f"({'tracked' if track else 'untracked'}): {finishes:,} assign + "
                    f"finish-with-child in {seconds:.2f} s wall, {cpu_seconds:.2f} s CPU = "
                    f"{rate:,.0f} finishes/s (CPU)",
                    flush=True,
                )
        print(
            f"best of {args.throughput_repeats} (CPU): tracked {best[True]:,.0f} finishes/s, "
            f"untracked {best[False]:,.0f} finishes/s ({best[True] / best[False]:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
