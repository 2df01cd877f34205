"""End-to-end no-op task throughput: Steward vs Celery + Redis vs Dramatiq + Redis.

Side by side in one run, each with 2 worker processes on this machine:

- Steward: ``steward standalone`` (every submission, assignment and finish is fsynced
  to its write-ahead log before it is acknowledged) + 2 ``steward worker`` processes
  (``--task-type noop=SLOTS``; tasks in task processes, or with ``--task-isolation thread``
  on the worker's thread pool). Submitted over HTTP in batches (one log
  entry per batch) on one keep-alive connection.
- Celery 5 + Redis (broker and result backend): 2 worker processes
  ``-P threads -c 8`` (or one prefork worker with 2 child processes:
  ``--celery-pool prefork``), see bench_peers/celery_app.py for the configuration.
  Submitted with ``send_task`` in a loop on one producer (Celery has no batch publish).
- Dramatiq + Redis: ``dramatiq --processes 2 --threads 8``, Results middleware with the
  Redis backend (bench_peers/dramatiq_app.py). Submitted with ``broker.enqueue`` in a
  loop on pre-built messages.

A run submits N tasks and waits until every one is finished *and recorded* (Steward:
finished in the broker's state, i.e. its Finish entry is durable; Celery/Dramatiq: the
task's result key exists in Redis), polling every ``--poll-ms``. Throughput = N / (time
from the first submit to the observed last completion). Each system gets a warm-up run
first, then ``--runs`` timed runs; medians and every run are printed. Redis runs without
persistence (``--save '' --appendonly no``) and, to compare durable with durable, with
``--appendonly yes --appendfsync always`` (a fresh redis-server per system and mode).

    python bench/bench_e2e.py                              # everything, 20,000 tasks x 3
    python bench/bench_e2e.py --tasks 5000 --runs 1 --redis volatile
    python bench/bench_e2e.py --systems steward --profile /tmp/prof   # + py-spy hot spots

Everything binds to 127.0.0.1; every wait is bounded (``--timeout-s`` per run); every
process started is stopped by its pid on exit, also on failure or Ctrl-C. Without
redis-server / celery / dramatiq it says how to install them and runs Steward alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers.harness import (
    CELERY_WORKER_ARGV,
    CpuMeter,
    Procs,
    Profiler,
    RawHttp,
    add_run_dir_options,
    available_systems,
    dramatiq_workers_argv,
    keys_present_from,
    median,
    parse_run_args,
    redis_version,
    source_revision,
    start_redis,
    start_steward,
    summarise_profile,
)

FINAL = ("finished", "error", "cancelled")
DISTURBED_CORES = 0.1  # other processes' load that makes a run not count


@dataclass
class Run:
    tasks: int
    submit_s: float  # first submit -> last submit acknowledged
    total_s: float  # first submit -> last completion observed
    failed: int = 0
    cores_ours: float = 0.0  # CPU cores used by this benchmark's processes, on average
    cores_other: float = 0.0  # by everything else on the machine (should be ~0)
    cores_by_process: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.tasks / self.total_s


@dataclass
class Outcome:
    system: str
    persistence: str
    runs: list[Run]
    error: str = ""
    profiled: Run | None = None
    disturbed: list[Run] = field(default_factory=list)  # discarded: other processes ran


class RunTimeout(TimeoutError):
    pass


# --- Steward -------------------------------------------------------------------------------------


def _done_failed(counts: dict[str, int]) -> tuple[int, int]:
    done = sum(counts.get(s, 0) for s in FINAL)
    return done, done - counts.get("finished", 0)


def steward_run(http: RawHttp, tasks: int, batch: int, poll_s: float, timeout_s: float) -> Run:
    task = b'{"type":"noop","tenant":"bench","params":null}'

    def request(k: int) -> bytes:
        return http.build("POST", "/api/v1/tasks", b'{"tasks":[' + b",".join([task] * k) + b"]}")

    full = request(batch)
    counts_request = http.build("GET", "/api/v1/cluster")

    def counts() -> dict[str, int]:
        status, body = http.send_raw(counts_request)
        if status != 200:
            raise RuntimeError(f"GET /api/v1/cluster: HTTP {status}")
        result: dict[str, int] = json.loads(body)["tasks"]
        return result

    base_done, base_failed = _done_failed(counts())
    started = time.perf_counter()
    submitted = 0
    while submitted < tasks:
        k = min(batch, tasks - submitted)
        status, body = http.send_raw(full if k == batch else request(k))
        if status != 200 or b'"error"' in body:
            raise RuntimeError(f"submit: HTTP {status}: {body[:300]!r}")
        submitted += k
    submit_s = time.perf_counter() - started
    deadline = started + timeout_s
    while True:
        done, failed = _done_failed(counts())
        if done - base_done >= tasks:
            break
        if time.perf_counter() > deadline:
            raise RunTimeout(f"{done - base_done}/{tasks} done after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return Run(tasks, submit_s, time.perf_counter() - started, failed - base_failed)


def bench_steward(args: argparse.Namespace, root: Path) -> Outcome:
    outcome = Outcome("steward", "own WAL, fsync each entry", [])
    with Procs(root / "logs" / "steward") as procs:
        cluster = start_steward(
            procs,
            root / "steward-data",
            workers=2,
            slots=args.steward_slots,
            task_isolation=args.task_isolation,
        )
        with RawHttp(cluster.port, timeout_s=60) as http:

            def once(n: int, timeout_s: float) -> Run:
                return steward_run(http, n, args.batch, args.poll_ms / 1000, timeout_s)

            timed_runs(outcome, once, args, procs)
            if args.profile and not outcome.error:
                profiler = Profiler(args.profile)
                targets = [("broker", cluster.broker.pid), ("worker1", cluster.workers[0].pid)]
                with profiler.recording(targets, "steward"):
                    outcome.profiled = once(args.tasks, args.timeout_s)
    return outcome


# --- Celery --------------------------------------------------------------------------------------


def wait_for_keys(
    client: Any, keys: list[str], started: float, timeout_s: float, poll_s: float
) -> None:
    """Poll Redis until every result key exists; RunTimeout ``timeout_s`` after ``started``."""
    deadline = started + timeout_s
    index = 0
    while (index := keys_present_from(client, keys, index)) < len(keys):
        if time.perf_counter() > deadline:
            raise RunTimeout(f"{index}+/{len(keys)} results stored after {timeout_s:.0f} s")
        time.sleep(poll_s)


def celery_run(app: Any, client: Any, tasks: int, poll_s: float, timeout_s: float) -> Run:
    from bench_peers.celery_app import TASK_NAME

    ids = [uuid.uuid4().hex for _ in range(tasks)]
    keys = [f"celery-task-meta-{task_id}" for task_id in ids]
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for task_id in ids:
            app.send_task(TASK_NAME, task_id=task_id, producer=producer)
    submit_s = time.perf_counter() - started
    wait_for_keys(client, keys, started, timeout_s, poll_s)
    total_s = time.perf_counter() - started
    sample = [v for v in client.mget(keys[-200:]) if v is None or b'"SUCCESS"' not in v]
    return Run(tasks, submit_s, total_s, failed=len(sample))


def bench_celery(args: argparse.Namespace, root: Path, durable: bool) -> Outcome:
    from bench_peers.celery_app import make_app
    from bench_peers.harness import child_env

    mode = "durable" if durable else "volatile"
    outcome = Outcome("celery", persistence_label(durable), [])
    with Procs(root / "logs" / f"celery-{mode}") as procs:
        server = start_redis(procs, root / f"redis-celery-{mode}", durable=durable)
        env = child_env(
            {
                "BENCH_REDIS_URL": server.url,
                "BENCH_CELERY_ACKS_LATE": "1" if args.celery_acks_late else "0",
            }
        )
        common = CELERY_WORKER_ARGV
        if args.celery_pool == "prefork":
            procs.start(
                "celery-worker",
                [*common, "-P", "prefork", "-c", "2", "-n", "bench1@%h"],
                env=env,
            )
        else:
            pool = ["-P", "solo"] if args.celery_pool == "solo" else ["-P", "threads"]
            pool += ["-c", "1" if args.celery_pool == "solo" else str(args.peer_threads)]
            for i in (1, 2):
                procs.start(f"celery-worker-{i}", [*common, *pool, "-n", f"bench{i}@%h"], env=env)
        app = make_app(server.url, with_results=False)
        timed_peer_runs(outcome, celery_run, app, server.url, args, procs, app.close)
    return outcome


# --- Dramatiq ------------------------------------------------------------------------------------


def dramatiq_run(app: Any, client: Any, tasks: int, poll_s: float, timeout_s: float) -> Run:
    messages = [app.noop.message() for _ in range(tasks)]
    keys = [app.backend.build_message_key(m) for m in messages]
    enqueue = app.broker.enqueue
    started = time.perf_counter()
    for message in messages:
        enqueue(message)
    submit_s = time.perf_counter() - started
    wait_for_keys(client, keys, started, timeout_s, poll_s)
    return Run(tasks, submit_s, time.perf_counter() - started)


def bench_dramatiq(args: argparse.Namespace, root: Path, durable: bool) -> Outcome:
    from bench_peers.dramatiq_app import make_app
    from bench_peers.harness import child_env

    mode = "durable" if durable else "volatile"
    outcome = Outcome("dramatiq", persistence_label(durable), [])
    with Procs(root / "logs" / f"dramatiq-{mode}") as procs:
        server = start_redis(procs, root / f"redis-dramatiq-{mode}", durable=durable)
        procs.start(
            "dramatiq-workers",
            dramatiq_workers_argv(args.peer_threads),
            env=child_env({"BENCH_REDIS_URL": server.url, "dramatiq_restart_delay": "0"}),
        )
        app = make_app(server.url)
        timed_peer_runs(outcome, dramatiq_run, app, server.url, args, procs, app.broker.close)
    return outcome


# --- common --------------------------------------------------------------------------------------


def persistence_label(durable: bool) -> str:
    return "redis AOF fsync always" if durable else "redis no persistence"


def timed_peer_runs(
    outcome: Outcome,
    run: Callable[[Any, Any, int, float, float], Run],
    app: Any,
    redis_url: str,
    args: argparse.Namespace,
    procs: Procs,
    close_app: Callable[[], None],
) -> None:
    """Timed runs of a peer: ``run(app, redis client, tasks, poll_s, timeout_s)``."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:

        def once(n: int, timeout_s: float) -> Run:
            return run(app, client, n, args.poll_ms / 1000, timeout_s)

        timed_runs(outcome, once, args, procs)
    finally:
        client.close()
        close_app()


def timed_runs(
    outcome: Outcome, once: Callable[[int, float], Run], args: argparse.Namespace, procs: Procs
) -> None:
    """Warm-up (also waits out worker start-up), then ``args.runs`` timed runs."""
    try:
        once(args.warmup, max(args.timeout_s, 120.0))
        reruns = args.rerun_disturbed
        while len(outcome.runs) < args.runs:
            procs.check_alive()
            meter = CpuMeter(procs)
            run = once(args.tasks, args.timeout_s)
            run.cores_ours, run.cores_other, run.cores_by_process = meter.measure()
            procs.check_alive()
            if run.cores_other >= DISTURBED_CORES and reruns > 0:
                outcome.disturbed.append(run)  # another process loaded the machine
                reruns -= 1
                continue
            outcome.runs.append(run)
    except (RunTimeout, RuntimeError, OSError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        for proc in procs.procs:
            print(f"  log of {proc.name} (pid {proc.pid}):\n{proc.tail(10)}", file=sys.stderr)


def print_outcome(outcome: Outcome) -> None:
    label = f"{outcome.system:<9} {outcome.persistence:<26}"
    if outcome.error and not outcome.runs:
        print(f"{label} FAILED: {outcome.error}")
        return
    rates = [r.rate for r in outcome.runs]
    each = "  ".join(
        f"{r.rate:>6,.0f} ({r.submit_s:.2f}/{r.total_s:.2f} s, {r.cores_ours:.1f}"
        + (f"+{r.cores_other:.1f}" if r.cores_other >= 0.05 else "")
        + " cores"
        + (f", {r.failed} failed" if r.failed else "")
        + ")"
        for r in outcome.runs
    )
    print(f"{label} {median(rates):>9,.0f}   {each}", flush=True)
    if outcome.error:
        print(f"{'':<36} then FAILED: {outcome.error}", flush=True)
    if outcome.runs:
        cores = outcome.runs[-1].cores_by_process
        split = ", ".join(f"{name} {value:.2f}" for name, value in sorted(cores.items()))
        print(f"{'':<36} CPU cores by process (last run): {split}")
    if outcome.disturbed:
        runs = ", ".join(f"{r.rate:,.0f} (+{r.cores_other:.1f} cores)" for r in outcome.disturbed)
        print(f"{'':<36} discarded and repeated, other processes ran: {runs}")
    if any(r.cores_other >= DISTURBED_CORES for r in outcome.runs):
        print(f"{'':<36} warning: other processes loaded the machine (+N cores): rerun")


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks per timed run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1_000, help="tasks in the warm-up run")
    parser.add_argument("--batch", type=int, default=1_000, help="Steward tasks per HTTP request")
    parser.add_argument("--steward-slots", type=int, default=64, help="noop slots per worker")
    parser.add_argument(
        "--task-isolation",
        choices=["process", "thread"],
        default="process",
        help="Steward workers run tasks in task processes (default) or in the worker",
    )
    parser.add_argument("--peer-threads", type=int, default=8, help="threads per peer worker")
    parser.add_argument("--celery-pool", choices=["threads", "prefork", "solo"], default="threads")
    parser.add_argument("--celery-acks-late", action="store_true")
    parser.add_argument("--redis", choices=["volatile", "durable", "both"], default="both")
    parser.add_argument("--systems", default="steward,celery,dramatiq")
    parser.add_argument("--poll-ms", type=float, default=10.0)
    parser.add_argument(
        "--rerun-disturbed",
        type=int,
        default=3,
        metavar="N",
        help="repeat up to N runs per system during which other processes used "
        f">= {DISTURBED_CORES} cores (shared machines)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on each run")
    add_run_dir_options(
        parser,
        profile_help="after the timed runs, one more Steward run under py-spy (broker, worker 1)",
    )
    args = parse_run_args(parser)
    systems = available_systems(args.systems)
    modes = {"volatile": [False], "durable": [True], "both": [False, True]}[args.redis]

    print(
        f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, steward "
        f"{source_revision()}; "
        f"{args.tasks:,} no-op tasks per run, {args.runs} runs after a {args.warmup:,}-task "
        f"warm-up; completion polled every {args.poll_ms:g} ms"
    )
    print(
        f"steward  {version('steward')}: standalone broker (fsync per log entry) + 2 workers "
        f"x noop={args.steward_slots} slots, task isolation {args.task_isolation};"
        f" HTTP batches of {args.batch:,}"
    )
    if "celery" in systems:
        pool = {
            "prefork": "1 worker -P prefork -c 2 (2 child processes)",
            "solo": "2 workers -P solo",
            "threads": f"2 workers -P threads -c {args.peer_threads}",
        }[args.celery_pool]
        acks = "acks late" if args.celery_acks_late else "acks early (default)"
        print(
            f"celery   {version('celery')} + redis-server {redis_version()}: {pool}, "
            f"prefetch x4, {acks}, results in redis; send_task loop"
        )
    if "dramatiq" in systems:
        print(
            f"dramatiq {version('dramatiq')} + redis-server {redis_version()}: 2 processes x "
            f"{args.peer_threads} threads, Results(RedisBackend); enqueue loop"
        )
    print()

    print(
        f"{'system':<9} {'durability':<26} {'median':>9}   "
        "each run: tasks/s (submit s / total s, CPU cores used)"
    )
    print(f"{'':<36} {'tasks/s':>9}")
    benches: list[Callable[[], Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="steward-e2e-", dir=args.data_root) as tmp:
        root = Path(tmp)
        if "steward" in systems:
            benches.append(partial(bench_steward, args, root))
        for durable in modes:
            if "celery" in systems:
                benches.append(partial(bench_celery, args, root, durable))
            if "dramatiq" in systems:
                benches.append(partial(bench_dramatiq, args, root, durable))
        outcomes: list[Outcome] = []
        for bench in benches:
            outcomes.append(bench())
            print_outcome(outcomes[-1])
    steward = next((o for o in outcomes if o.system == "steward" and o.runs), None)
    if steward is not None:
        ours = median([r.rate for r in steward.runs])
        for durable in modes:
            peers = [
                o
                for o in outcomes
                if o.system != "steward" and o.runs and o.persistence == persistence_label(durable)
            ]
            if peers:
                best = max(peers, key=lambda o: median([r.rate for r in o.runs]))
                theirs = median([r.rate for r in best.runs])
                print(
                    f"ratio steward / faster peer ({persistence_label(durable)}): "
                    f"{ours / theirs:.2f}x ({best.system} {theirs:,.0f} tasks/s)"
                )
        if steward.profiled is not None and args.profile is not None:
            print(
                f"\nprofiled steward run (py-spy --gil {Profiler(args.profile).rate} Hz, "
                f"not in the figures above): {steward.profiled.rate:,.0f} tasks/s"
            )
            for name in ("broker", "worker1"):
                print(f"py-spy {name} ({args.profile / f'steward-{name}.txt'}):")
                print(summarise_profile(args.profile / f"steward-{name}.txt"))


if __name__ == "__main__":
    main()
