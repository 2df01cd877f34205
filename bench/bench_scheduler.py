"""Scheduler throughput and broker memory per waiting task, in process.

For each waiting-queue size N (default 10,000 and 1,000,000) across 1,000
tenants with random (seeded) weights, on 50 workers with 200 slots each:

1. builds the state by applying real ``SubmitTasks`` entries (~100-byte params)
   and reports the broker's memory per waiting task (RSS delta of that build,
   and tracemalloc on a separate build of at most ``--trace-max`` tasks);
2. runs scheduling rounds the way the leader does: ``schedule`` -> one
   ``AssignTasks`` entry -> ``apply`` -> some tasks finish (``FinishTasks``),
   in two phases: "empty" (each round fills the empty cluster, then all the
   tasks it assigned finish) and "saturated" (each round first finishes the
   oldest 1,000 running tasks, so every call sees ~9,000 running tasks and
   pays the per-round setup over them). Each assigned task is replaced by a
   new submission of the same tenant, so N stays constant.

Only ``schedule`` is timed for the assignment rate; ``apply`` of the
``AssignTasks`` entries is timed separately; submissions and finishes are not
timed. Wall and CPU (process) time are both printed. Asserts nothing about
timing.

    python bench/bench_scheduler.py
    python bench/bench_scheduler.py --waiting 10000 100000 1000000 --rounds 20
    python bench/bench_scheduler.py --priorities 10   # tasks spread over 10 priorities
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass, field

from broker.core import Rejected, StateMachine, Task
from broker.core import entries as e
from broker.core.scheduler import schedule

T0 = 1_700_000_000_000
PARAMS_BYTES = 100
SUBMIT_BATCH = 1000
RATES_PREFIX = "# rates "


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Driver:
    """A StateMachine fed with entries the way the leader would log them."""

    def __init__(self, seed: int, tenants: int, priorities: int = 1) -> None:
        self.m = StateMachine()
        self.rng = random.Random(seed)
        self.priorities = priorities  # > 1: each task a random priority 0..priorities-1
        self.now = T0
        self.next_id = 0
        self.tenant_names = [f"tenant-{i:04d}" for i in range(tenants)]

    def apply(self, entry: e.Entry) -> object:
        self.now += 1
        return self.m.apply(entry).result

    def setup_cluster(self, workers: int, slots: int) -> None:
        for i in range(workers):
            self.apply(
                e.RegisterWorker(
                    time_ms=self.now,
                    worker_id=f"worker-{i:03d}",
                    task_types={"*": slots},
                    resources={"cpu": float(slots), "memory_mb": slots * 2048.0},
                )
            )
        for name in self.tenant_names:
            weight = round(self.rng.uniform(0.5, 8.0), 2)
            self.apply(
                e.SetTenant(
                    time_ms=self.now, tenant=name, limits=e.TenantLimitsPatch(weight=weight)
                )
            )

    def spec(self, tenant: str) -> e.TaskSpec:
        self.next_id += 1
        head = b'{"input":"s3://bucket/data/part-%08d.parquet","tenant":"%s","pad":"' % (
            self.next_id,
            tenant.encode(),
        )
        params = head + b"x" * max(0, PARAMS_BYTES - len(head) - 2) + b'"}'
        return e.TaskSpec(
            id=self.next_id,
            type="py" if self.next_id % 4 else "spark",
            tenant=tenant,
            params=params,
            resources={"cpu": 1.0, "memory_mb": 1024.0},
            priority=self.rng.randrange(self.priorities) if self.priorities > 1 else 0,
        )

    def submit(self, tenants: list[str]) -> None:
        for start in range(0, len(tenants), SUBMIT_BATCH):
            batch = tuple(self.spec(t) for t in tenants[start : start + SUBMIT_BATCH])
            self.apply(e.SubmitTasks(time_ms=self.now, tasks=batch))

    def submit_random(self, count: int) -> None:
        names = self.tenant_names
        self.submit([names[self.rng.randrange(len(names))] for _ in range(count)])


class Clock:
    """Wall and CPU time of the timed sections (CPU time is steadier on a busy machine)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.samples: list[float] = []  # wall seconds per section

    def __enter__(self) -> Clock:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        self.wall += wall
        self.cpu += time.process_time() - self._cpu
        self.samples.append(wall)


class _CountingTasks(dict[int, Task]):
    reads = 0

    def __getitem__(self, key: int) -> Task:
        self.reads += 1
        return super().__getitem__(key)


@dataclass
class Phase:
    """Rounds of one kind: schedule -> AssignTasks applied -> some tasks finished."""

    title: str
    rounds: int = 0
    assigned: int = 0
    running_at_call: int = 0  # summed over rounds
    schedule: Clock = field(default_factory=Clock)
    setup: Clock = field(default_factory=Clock)  # schedule(max_assignments=1)
    apply: Clock = field(default_factory=Clock)
    queue_reads: float = 0.0  # waiting-task records read per assignment


@dataclass
class Figures:
    waiting: int
    build_s: float
    rss_per_task: float
    phases: list[Phase]
    traced_per_task: float | None = None
    traced_sample: int = 0


def traced_bytes_per_task(args: argparse.Namespace, count: int) -> float:
    """Bytes per waiting task still allocated after building a state (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    d = Driver(args.seed, args.tenants, args.priorities)
    d.submit_random(count)
    gc.collect()
    traced = (tracemalloc.get_traced_memory()[0] - before) / count
    tracemalloc.stop()
    del d
    return traced


class Bench:
    def __init__(self, args: argparse.Namespace, waiting: int) -> None:
        self.args = args
        self.waiting = waiting
        gc.collect()
        rss0 = rss_bytes()
        t = time.perf_counter()
        self.d = Driver(args.seed, args.tenants, args.priorities)
        self.d.setup_cluster(args.workers, args.slots)
        self.d.submit_random(waiting)
        self.build_s = time.perf_counter() - t
        gc.collect()
        self.rss_per_task = (rss_bytes() - rss0) / waiting
        self.m = self.d.m
        self.batches: deque[list[e.Assignment]] = deque()  # running, oldest batch first

    def round(self, phase: Phase, max_assignments: int) -> None:
        d, m = self.d, self.m
        phase.rounds += 1
        phase.running_at_call += len(m.by_state["running"])
        with phase.setup:
            schedule(m, max_assignments=1)
        with phase.schedule:
            assignments = schedule(m, max_assignments=max_assignments)
        phase.assigned += len(assignments)
        entry = e.AssignTasks(time_ms=d.now, assignments=tuple(assignments))
        with phase.apply:
            results = d.apply(entry)
        assert isinstance(results, list)
        assert not any(isinstance(r, Rejected) for r in results)
        self.batches.append(assignments)
        # Keep N waiting: each started task is replaced by one of the same tenant.
        d.submit([m.tasks[a.task_id].tenant for a in assignments])

    def finish_oldest(self, count: int) -> None:
        outcomes: list[e.TaskOutcome] = []
        while count > 0 and self.batches:
            take, rest = self.batches[0][:count], self.batches[0][count:]
            for a in take:
                attempt = self.m.tasks[a.task_id].attempt
                outcomes.append(e.TaskOutcome(a.task_id, a.worker_id, attempt, ok=True))
            count -= len(take)
            if rest:
                self.batches[0] = rest
            else:
                self.batches.popleft()
        self.d.apply(e.FinishTasks(time_ms=self.d.now, outcomes=tuple(outcomes)))

    def queue_reads(self, max_assignments: int) -> float:
        """Waiting-task records one schedule call reads per assignment (machine-independent).

        Counted as the task reads of ``schedule(max_assignments)`` minus those of
        ``schedule(1)`` on the same state (both read every running task once).
        """
        m = self.m
        original = m.tasks
        counting = m.tasks = _CountingTasks(original)
        try:
            reads = []
            for limit in (1, max_assignments):
                counting.reads = 0
                made = len(schedule(m, max_assignments=limit))
                reads.append((counting.reads, made))
        finally:
            m.tasks = original
        (one, _), (many, made) = reads
        return (many - one) / max(1, made - 1)

    def run(self) -> Figures:
        args = self.args
        slots = args.workers * args.slots
        # Fill the empty cluster, finish what was assigned, again.
        empty = Phase(f"empty cluster each round, schedule(max_assignments={slots:,})")
        for _ in range(args.empty_rounds):
            self.round(empty, slots)
            self.finish_oldest(slots)
        empty.queue_reads = self.queue_reads(slots)
        # Saturated: each round frees the oldest batch, so ~slots - batch tasks run
        # at every call and the per-round setup over running tasks is paid in full.
        batch = args.max_assignments
        full = Phase(f"saturated cluster, schedule(max_assignments={batch:,})")
        warm = Phase("warm-up")
        self.round(warm, slots)
        for _ in range(args.rounds):
            self.finish_oldest(batch)
            self.round(full, batch)
        self.finish_oldest(batch)
        full.queue_reads = self.queue_reads(batch)
        assert len(self.m.by_state["waiting"]) == self.waiting
        return Figures(self.waiting, self.build_s, self.rss_per_task, [empty, full])


def rate(count: int, clock: Clock) -> str:
    return (
        f"{count / clock.wall:,.0f}/s wall ({clock.wall / count * 1e6:.2f} us each), "
        f"{count / clock.cpu:,.0f}/s CPU ({clock.cpu / count * 1e6:.2f} us each)"
    )


def report(f: Figures) -> None:
    print(f"--- {f.waiting:,} waiting tasks ---")
    print(f"  build state (SubmitTasks applied): {f.build_s:.2f} s")
    mem = f"  memory per waiting task: {f.rss_per_task:,.0f} B (RSS delta of the build)"
    if f.traced_per_task is not None:
        mem += f", {f.traced_per_task:,.0f} B (tracemalloc, {f.traced_sample:,}-task build)"
    print(mem)
    for p in f.phases:
        rounds = max(1, p.rounds)
        print(
            f"  {p.title}: {p.rounds} rounds, {p.assigned:,} assignments, "
            f"~{p.running_at_call // rounds:,} running at each call"
        )
        print(f"    schedule:           {rate(p.assigned, p.schedule)}")
        ms = sorted(s * 1000 for s in p.schedule.samples)
        print(
            f"    schedule per round: median {statistics.median(ms):.2f} ms, "
            f"max {ms[-1]:.2f} ms wall, mean {p.schedule.cpu / rounds * 1000:.2f} ms CPU; "
            f"fixed setup (max_assignments=1): {p.setup.cpu / rounds * 1000:.2f} ms CPU"
        )
        print(f"    apply(AssignTasks): {rate(p.assigned, p.apply)}")
        print(f"    waiting-task records read per assignment: {p.queue_reads:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    # The last --waiting given wins (a child gets the parent's argv plus its own).
    parser.add_argument("--waiting", type=int, nargs="+", action="append")
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--slots", type=int, default=200)
    parser.add_argument("--empty-rounds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--max-assignments", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--priorities", type=int, default=1, help="tasks get random priorities 0..N-1 (1: all 0)"
    )
    parser.add_argument("--trace-max", type=int, default=200_000, help="0: no tracemalloc")
    args = parser.parse_args()
    args.waiting = args.waiting[-1] if args.waiting else [10_000, 100_000, 1_000_000]
    print(
        f"scheduler bench: {args.tenants:,} tenants (weights 0.5-8, seed {args.seed}), "
        f"{args.workers} workers x {args.slots} slots, tasks ask cpu=1 memory_mb=1024, "
        f"params {PARAMS_BYTES} B, {args.priorities} priorities; "
        "CPU = process time (wall is inflated on a busy machine)"
    )
    if len(args.waiting) > 1:
        # One child process per size: a fresh heap keeps the RSS delta honest (memory
        # freed by an earlier size would be reused) and the timings independent.
        summaries: dict[int, dict[str, dict[str, float]]] = {}
        for waiting in args.waiting:
            argv = [sys.executable, __file__, *sys.argv[1:], "--waiting", str(waiting)]
            child = subprocess.run(argv, check=True, capture_output=True, text=True)
            for line in child.stdout.splitlines():
                if line.startswith(RATES_PREFIX):
                    summaries[waiting] = json.loads(line.removeprefix(RATES_PREFIX))
                elif not line.startswith("scheduler bench:"):
                    print(line)
        print("by waiting tasks (schedule assignments/s CPU; waiting-task records read each):")
        first, last = summaries[args.waiting[0]], summaries[args.waiting[-1]]
        for title in first:
            print(
                f"  {title}: "
                + ", ".join(
                    f"{n:,}: {s[title]['rate']:,.0f}/s, {s[title]['reads']:.3f} reads"
                    for n, s in summaries.items()
                )
                + f"; rate largest/smallest queue: {last[title]['rate'] / first[title]['rate']:.2f}"
            )
        return
    (waiting,) = args.waiting
    figures = Bench(args, waiting).run()
    gc.collect()
    # Traced on a separate build once the timed state is gone: tracemalloc slows
    # allocation several times over, so at most --trace-max tasks (per task, the
    # figure does not depend on N).
    figures.traced_sample = min(waiting, args.trace_max)
    if figures.traced_sample > 0:
        figures.traced_per_task = traced_bytes_per_task(args, figures.traced_sample)
    report(figures)
    summary = {
        p.title: {"rate": p.assigned / p.schedule.cpu, "reads": p.queue_reads}
        for p in figures.phases
    }
    print(RATES_PREFIX + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
