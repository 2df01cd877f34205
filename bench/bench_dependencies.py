"""Scheduler cost with tasks blocked by dependencies (``after``), in process.

Builds a state with ``--runnable`` waiting tasks over ``--tenants`` tenants and, for each
``--blocked`` count B, B more tasks each submitted ``after`` one long-running task (so they
stay blocked), on ``--workers`` workers with ``--slots`` slots; then times ``schedule``
(the leader's round: picks assignments over the queues, applies nothing) ``--rounds``
times on the same state. Blocked tasks are in no queue, so the time per round should not
depend on B. The states are built once, then the rounds alternate between them (so the
machine's load drifts over all of them alike); medians are printed. Asserts nothing.

    python bench/bench_dependencies.py
    python bench/bench_dependencies.py --blocked 0 10000 200000 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time

from broker.core import StateMachine, TaskRef
from broker.core import entries as e
from broker.core.scheduler import schedule

T0 = 1_700_000_000_000


def build(args: argparse.Namespace, blocked: int) -> StateMachine:
    m = StateMachine()
    next_id = 0

    def submit(specs: list[e.TaskSpec]) -> None:
        result = m.apply(e.SubmitTasks(time_ms=T0, tasks=tuple(specs))).result
        assert isinstance(result, list) and all(isinstance(r, TaskRef) for r in result)

    for w in range(args.workers):
        m.apply(e.RegisterWorker(time_ms=T0, worker_id=f"w{w}", task_types={"*": args.slots}))
    # The dependency every blocked task waits for (never run here).
    next_id += 1
    anchor = next_id
    submit([e.TaskSpec(id=anchor, type="py", tenant="t1")])
    for start in range(0, blocked, 10_000):
        specs = []
        for _ in range(min(10_000, blocked - start)):
            next_id += 1
            specs.append(e.TaskSpec(id=next_id, type="py", tenant="t1", after=(anchor,)))
        submit(specs)
    for start in range(0, args.runnable, 10_000):
        specs = []
        for i in range(min(10_000, args.runnable - start)):
            next_id += 1
            specs.append(e.TaskSpec(id=next_id, type="py", tenant=f"t{i % args.tenants}"))
        submit(specs)
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runnable", type=int, default=10_000)
    parser.add_argument("--blocked", type=int, nargs="+", default=[0, 10_000, 200_000])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    states = {b: build(args, b) for b in args.blocked}
    times: dict[int, list[float]] = {b: [] for b in args.blocked}
    counts: dict[int, int] = {}
    for _ in range(args.rounds):
        for blocked, state in states.items():
            started = time.perf_counter()
            assignments = schedule(state)
            times[blocked].append(time.perf_counter() - started)
            counts[blocked] = len(assignments)
    print(
        f"{args.runnable} runnable tasks, {args.workers} x {args.slots} slots, {args.rounds} rounds"
    )
    print(f"{'blocked':>10} {'assigned':>9} {'median ms/round':>16} {'min ms':>8}")
    for blocked in args.blocked:
        median = statistics.median(times[blocked]) * 1000
        print(
            f"{blocked:>10} {counts[blocked]:>9} {median:>16.2f} {min(times[blocked]) * 1000:>8.2f}"
        )


if __name__ == "__main__":
    main()
