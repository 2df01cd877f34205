"""Steward, Dramatiq, Celery and RQ side by side: every mode, one table, same work.

One command runs every system in every submission mode it has, with the same task
count, the same 2 worker processes x ``--slots`` slots (RQ: one job at a time per
worker process, it has no concurrency setting) and one client, and prints one table:

    system | mode | durable | submit tasks/s | end to end tasks/s | round trip p50 / p99 ms

- submit: tasks acknowledged per second (first submit -> last acknowledgement);
- end to end: first submit -> every result recorded (Steward: the task is final in the
  broker's state, i.e. its finish is durable; peers: the result is stored in Redis),
  polled every ``--poll-ms``;
- round trip: closed loop, one task at a time: submit it and wait for its result, the
  way each system's docs show (``--round-trips`` of them after a warm-up); shown on the
  per-call row.

A row compares only like with like: per-call rows submit one call per task, batched rows
use the system's own batch call. No figure compares one system's batch with another's
single calls.

How each system is called (see bench/README.md for the configurations):

- Steward (``steward standalone``, every submission, assignment and finish fsynced to its
  write-ahead log under group commit, + 2 ``steward worker --task-type noop=SLOTS``, task
  isolation ``process`` by default), through the public ``StewardClient``:
  per-call ``client.submit("noop", tenant=...)``; producer
  ``with client.producer(linger_ms=L, max_batch=B) as p: [p.submit(...)]`` then every
  ``future.result()`` (skipped, saying so, in a checkout without ``producer``);
  batched ``client.submit_many([...])`` in batches of ``--batch``; round trip
  ``client.submit(...).result(timeout=...)``.
- Dramatiq + Redis (``dramatiq --processes 2 --threads SLOTS``, Results middleware):
  per-call ``actor.send()``; batched ``group(messages).run()`` (in dramatiq 2.2.1 a
  group enqueues its messages one at a time: it has no batch publish); round trip
  ``send().get_result(block=True)``.
- Celery + Redis (2 workers ``-P threads -c SLOTS``; Celery's default pool is prefork,
  ``--celery-pool prefork`` gives it, 2 workers x SLOTS child processes):
  per-call ``task.delay()``; batched ``group(...).apply_async()``; round trip
  ``delay().get()``.
- RQ + Redis (2 ``rq worker``, RQ's default forking ``Worker``): per-call
  ``queue.enqueue()``; batched ``queue.enqueue_many()`` (one pipeline); round trip
  ``enqueue().latest_result(timeout=...)``. Without rq installed it says how to
  install it and runs the rest.

Durable: Steward yes (fsync per group commit); a peer on Redis without persistence no
(``--redis volatile``, the default); ``--redis durable`` or ``both`` adds each peer on a
Redis with AOF ``appendfsync always`` (fsync before every reply): yes.

    python bench/bench_e2e.py --quick                 # small counts, ~2 minutes
    python bench/bench_e2e.py                         # 5,000 tasks per mode, ~10 minutes
    python bench/bench_e2e.py --redis both --runs 3   # + durable Redis, medians of 3
    python bench/bench_e2e.py --systems steward --profile /tmp/prof   # + py-spy hot spots

Everything binds to 127.0.0.1; every wait is bounded (``--timeout-s`` per run); every
process started is stopped by its pid on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers.harness import (
    CpuMeter,
    Procs,
    Profiler,
    add_run_dir_options,
    available_systems,
    median,
    parse_run_args,
    percentile,
    redis_version,
    source_revision,
    summarise_profile,
)
from bench_peers.systems import Celery, Dramatiq, Rq, Steward, System

DISTURBED_CORES = 0.1  # other processes' load worth flagging next to a figure
MODES = ("per-call", "producer", "batched")


class RunTimeout(TimeoutError):
    pass


@dataclass
class Row:
    system: str
    mode: str
    durable: bool
    note: str
    submit: list[float] = field(default_factory=list)  # tasks/s acknowledged, per run
    e2e: list[float] = field(default_factory=list)  # tasks/s recorded, per run
    round_trips: list[float] = field(default_factory=list)  # seconds each
    other_cores: float = 0.0  # most other processes' load seen during a run
    failed: int = 0
    error: str = ""


def end_to_end(
    system: System, mode: str, n: int, args: argparse.Namespace, procs: Procs, row: Row
) -> None:
    """One timed run of ``n`` tasks in ``mode``; appends its figures to ``row``."""
    logged = system.log_counts()
    meter = CpuMeter(procs)
    started = time.perf_counter()
    remaining = system.submit(mode, n, args.batch)
    submit_s = time.perf_counter() - started
    deadline = started + args.timeout_s
    while (left := remaining()) > 0:
        if time.perf_counter() > deadline:
            raise RunTimeout(f"{left}/{n} not recorded {args.timeout_s:.0f} s after the start")
        time.sleep(args.poll_ms / 1000)
    total_s = time.perf_counter() - started
    _, other, cores_by_process = meter.measure()
    procs.check_alive()
    logged_after = system.log_counts()
    log_note = ""
    if logged is not None and logged_after is not None:
        # Durable entries and group commits (fsyncs) per task (Steward's /metrics).
        entries = logged_after[0] - logged[0]
        commits = logged_after[1] - logged[1]
        log_note = f"; log: {entries / n:.2f} entries, {commits / n:.2f} group commits per task"
    row.submit.append(n / submit_s)
    row.e2e.append(n / total_s)
    row.other_cores = max(row.other_cores, other)
    row.failed += system.failed
    print(
        f"  {system.name} {mode}: {n:,} tasks, acknowledged in {submit_s:.2f} s, "
        f"recorded in {total_s:.2f} s"
        + (f" (other processes +{other:.1f} cores)" * (other > 0))
        # CPU per task of each process (with its live children: workers' task processes;
        # "client" is this process, its polling included), where the time goes.
        + "; CPU per task: "
        + ", ".join(
            f"{name} {cores * total_s / n * 1e6:,.0f} µs"
            for name, cores in sorted(cores_by_process.items())
        )
        + log_note,
        file=sys.stderr,
        flush=True,
    )


def round_trips(system: System, n: int, warmup: int, max_s: float) -> list[float]:
    deadline = time.monotonic() + max_s
    times: list[float] = []
    for i in range(warmup + n):
        if time.monotonic() > deadline:
            raise RunTimeout(f"only {max(0, i - warmup)}/{n} round trips within {max_s:.0f} s")
        started = time.perf_counter()
        system.round_trip()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def bench_system(
    label: str,
    start: Callable[[Procs], System],
    args: argparse.Namespace,
    root: Path,
    after: list[str],
) -> list[Row]:
    """Start one system, warm it up, run every mode ``args.runs`` times, then round trips;
    text to print after the table (a profile) goes to ``after``."""
    rows: list[Row] = []
    with Procs(root / "logs" / label) as procs:
        try:
            system = start(procs)
        except (TimeoutError, RuntimeError, OSError) as exc:
            return [Row(label, "-", False, "", error=f"start: {type(exc).__name__}: {exc}")]
        try:
            modes = [m for m in args.modes if m in system.modes]
            for mode in modes:
                rows.append(Row(system.name, mode, system.durable, system.modes[mode]))
                why = system.unavailable(mode)
                if why:
                    rows[-1].error = f"skipped: {why}"
                    print(f"  {system.name} {mode}: skipped: {why}", file=sys.stderr)
            if not rows:
                rows.append(Row(system.name, "round trip", system.durable, ""))
            live = [r for r in rows if not r.error and r.mode in system.modes]
            # At least one task: the warm-up also waits out the peers' worker start-up.
            warmup = max(1, args.warmup)
            end_to_end(system, "per-call", warmup, args, procs, Row("", "", False, ""))
            for _ in range(args.runs):
                for row in live:
                    end_to_end(system, row.mode, args.tasks, args, procs, row)
            if args.round_trips:
                target = next((r for r in rows if r.mode == "per-call"), rows[0])
                target.round_trips = round_trips(
                    system, args.round_trips, args.round_trip_warmup, args.timeout_s
                )
            if args.profile is not None and isinstance(system, Steward):
                after += profile_steward(system, args, procs)
        except Exception as exc:  # one system failing must not lose the others' figures
            error = f"{type(exc).__name__}: {exc}"
            for row in rows:
                row.error = row.error or error
            if not rows:
                rows.append(Row(label, "-", False, "", error=error))
            for proc in procs.procs:
                print(f"  log of {proc.name} (pid {proc.pid}):\n{proc.tail(10)}", file=sys.stderr)
        finally:
            system.close()
    return rows


def profile_steward(system: Steward, args: argparse.Namespace, procs: Procs) -> list[str]:
    """Per-call submits and round trips again under py-spy (this client, the broker, worker
    1): where a per-call submit's time goes. Summaries to print."""
    assert args.profile is not None
    profiler = Profiler(args.profile)
    targets = [("client", os.getpid()), *system.pids]
    with profiler.recording(targets, "steward"):
        end_to_end(system, "per-call", args.tasks, args, procs, Row("", "", True, ""))
        round_trips(system, args.round_trips, 0, args.timeout_s)
    lines = [
        f"\npy-spy --gil {profiler.rate} Hz, a per-call run and round trips (not in the table)"
    ]
    for name, _pid in targets:
        path = args.profile / f"steward-{name}.txt"
        lines.append(f"py-spy {name} ({path}):\n{summarise_profile(path)}")
    return lines


# --- the table -----------------------------------------------------------------------------------


def rate(values: Sequence[float]) -> str:
    return f"{median(values):,.0f}" if values else "-"


def latency(values: Sequence[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * percentile(ordered, 0.5):.2f} / {1000 * percentile(ordered, 0.99):.2f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| system | mode | durable | submit tasks/s | end to end tasks/s "
        "| round trip p50 / p99 ms | notes |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        notes = [row.error] if row.error else [row.note]
        if row.failed:
            notes.append(f"{row.failed} tasks failed")
        if row.other_cores >= DISTURBED_CORES:
            notes.append(f"other processes used up to {row.other_cores:.1f} cores")
        durable = "yes" if row.durable else "no"
        lines.append(
            f"| {row.system} | {row.mode} | {durable} | {rate(row.submit)} | {rate(row.e2e)} "
            f"| {latency(row.round_trips)} | {'; '.join(n for n in notes if n)} |"
        )
    return "\n".join(lines)


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def describe(args: argparse.Namespace, systems: list[str]) -> list[str]:
    redis = f"redis-server {redis_version()}"
    lines = [
        f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, steward "
        f"{source_revision()}, {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"{args.tasks:,} no-op tasks per mode and run, {args.runs} run(s) (medians), after a "
        f"{args.warmup:,}-task warm-up; {args.round_trips:,} round trips after "
        f"{args.round_trip_warmup}; 2 worker processes x {args.slots} slots; batches of "
        f"{args.batch:,}; one client; results polled every {args.poll_ms:g} ms",
    ]
    if "steward" in systems:
        lines.append(
            f"steward  {version('steward')}: standalone broker (file ledger, fsync per group "
            f"commit) + 2 workers, task isolation {args.task_isolation}; producer linger "
            f"{args.linger_ms:g} ms, max_batch {args.batch:,}"
        )
    if "dramatiq" in systems:
        lines.append(
            f"dramatiq {version('dramatiq')} + {redis}: --processes 2 --threads {args.slots}, "
            "default middleware + Results(RedisBackend), acks after the actor ran"
        )
    if "celery" in systems:
        acks = "acks late" if args.celery_acks_late else "acks early (Celery's default)"
        lines.append(
            f"celery   {version('celery')} + {redis}: 2 workers -P {args.celery_pool} "
            f"-c {args.slots}, prefetch x4, {acks}, results in Redis"
        )
    if "rq" in systems:
        worker = {"fork": "default forking Worker", "simple": "SimpleWorker"}[args.rq_worker]
        lines.append(
            f"rq       {version('rq')} + {redis}: 2 `rq worker` ({worker}, one job at a time "
            "each), results in Redis"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts: the table in ~2 min")
    parser.add_argument("--tasks", type=int, default=None, help="per mode and run (5,000)")
    parser.add_argument("--runs", type=int, default=1, help="timed runs per mode (medians)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up tasks (1,000)")
    parser.add_argument("--round-trips", "--n", type=int, default=None, help="timed (1,000)")
    parser.add_argument("--round-trip-warmup", type=int, default=None, help="(100)")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated, of per-call,producer,batched ('none': round trips only)",
    )
    parser.add_argument("--batch", type=int, default=100, help="tasks per batch / max_batch")
    parser.add_argument("--linger-ms", type=float, default=5.0, help="Steward producer linger")
    parser.add_argument("--slots", type=int, default=8, help="slots per worker process")
    parser.add_argument("--task-isolation", choices=["process", "thread"], default="process")
    parser.add_argument("--celery-pool", choices=["threads", "prefork"], default="threads")
    parser.add_argument("--celery-acks-late", action="store_true")
    parser.add_argument(
        "--rq-worker",
        choices=["fork", "simple"],
        default="fork",
        help="RQ's default forking Worker, or SimpleWorker (no fork per job)",
    )
    parser.add_argument("--redis", choices=["volatile", "durable", "both"], default="volatile")
    parser.add_argument("--systems", default="steward,dramatiq,celery,rq")
    parser.add_argument("--poll-ms", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on each run")
    add_run_dir_options(
        parser,
        profile_help="then a Steward per-call run and round trips under py-spy (broker, worker 1)",
    )
    args = parse_run_args(parser, argv)
    small = {"tasks": 1_000, "warmup": 200, "round_trips": 200, "round_trip_warmup": 20}
    full = {"tasks": 5_000, "warmup": 1_000, "round_trips": 1_000, "round_trip_warmup": 100}
    for name, value in (small if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.modes = [m for m in args.modes.split(",") if m in MODES]
    return args


def starters(
    args: argparse.Namespace, systems: list[str], root: Path
) -> list[tuple[str, Callable[[Procs], System]]]:
    """(label, start) for each system and Redis mode, in the order they run."""
    found: list[tuple[str, Callable[[Procs], System]]] = []
    if "steward" in systems:
        steward = partial(
            Steward,
            root=root,
            slots=args.slots,
            isolation=args.task_isolation,
            linger_ms=args.linger_ms,
        )
        found.append(("steward", steward))
    redis_modes = {"volatile": [False], "durable": [True], "both": [False, True]}[args.redis]
    for durable in redis_modes:
        tag = "durable" if durable else "volatile"
        peers: dict[str, Callable[[Procs], System]] = {
            "dramatiq": partial(Dramatiq, root=root, durable=durable, slots=args.slots),
            "celery": partial(
                Celery,
                root=root,
                durable=durable,
                slots=args.slots,
                pool=args.celery_pool,
                acks_late=args.celery_acks_late,
            ),
            "rq": partial(Rq, root=root, durable=durable, simple=args.rq_worker == "simple"),
        }
        found += [(f"{name}-{tag}", start) for name, start in peers.items() if name in systems]
    return found


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    systems = available_systems(args.systems)
    header = describe(args, systems)
    print("\n".join(header), flush=True)
    with tempfile.TemporaryDirectory(prefix="steward-e2e-", dir=args.data_root) as tmp:
        root = Path(tmp)
        rows: list[Row] = []
        after: list[str] = []
        for label, start in starters(args, systems, root):
            print(f"{label} ...", file=sys.stderr, flush=True)
            rows += bench_system(label, start, args, root, after)
    print()
    print(table(rows))
    print(
        "\nper-call rows: one call per task; batched/producer rows: the system's own batch "
        "call; round trip: one task submitted and its result awaited, closed loop"
    )
    print("\n".join(after))


if __name__ == "__main__":
    main()
