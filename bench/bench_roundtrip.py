"""Submit-to-result round trip of one no-op task, closed loop, one client.

For each system, with 2 worker processes attached (as in bench_e2e.py): submit one no-op
task, wait for its result, repeat; ``--warmup`` round trips first (not counted), then
``--n`` timed ones; prints p50/p90/p99/max in ms.

- Steward: ``POST /api/v1/tasks`` (acknowledged once the submission is fsynced), then
  ``GET /api/v1/tasks/{id}?wait_s=5`` (long poll, answers when the task is final, i.e.
  once its finish is fsynced), both on one keep-alive connection written from pre-built
  bytes (raw socket), so the client costs little. Also prints the submit part alone.
- Celery + Redis: ``noop.delay().get(timeout=5)`` (result via the Redis backend's
  pub/sub), 2 workers ``-P threads -c 8``; Redis without persistence.
- Dramatiq + Redis: ``noop.send().get_result(block=True, timeout=5000)``,
  ``--processes 2 --threads 8``; Redis without persistence. Dramatiq's Redis consumer
  polls an empty queue with a growing back-off, which shows in a closed loop.

    python bench/bench_roundtrip.py                       # Steward, Celery, Dramatiq
    python bench/bench_roundtrip.py --systems steward --n 5000
    python bench/bench_roundtrip.py --systems steward --task-isolation thread
    python bench/bench_roundtrip.py --systems steward --profile /tmp/rt-prof  # + py-spy

Everything binds to 127.0.0.1; each wait is bounded; every process is stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers.harness import (
    CELERY_WORKER_ARGV,
    CpuMeter,
    Procs,
    Profiler,
    RawHttp,
    add_run_dir_options,
    available_systems,
    child_env,
    dramatiq_workers_argv,
    parse_run_args,
    percentile,
    source_revision,
    start_redis,
    start_steward,
    summarise_profile,
)

WAIT_S = 5.0


def closed_loop(
    one: Callable[[], float | None], n: int, warmup: int, max_s: float
) -> tuple[list[float], list[float]]:
    """Run ``one`` warmup + n times; its wall time per call and what it reports itself."""
    deadline = time.monotonic() + max_s
    totals: list[float] = []
    parts: list[float] = []
    for i in range(warmup + n):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {max(0, i - warmup)}/{n} round trips within {max_s:.0f} s")
        started = time.perf_counter()
        part = one()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            totals.append(elapsed)
            if part is not None:
                parts.append(part)
    return totals, parts


def line(label: str, values: list[float]) -> str:
    ordered = sorted(values)
    ms = [1000 * percentile(ordered, f) for f in (0.5, 0.9, 0.99)]
    return (
        f"{label:<28} p50 {ms[0]:6.2f} ms  p90 {ms[1]:6.2f} ms  p99 {ms[2]:6.2f} ms  "
        f"max {1000 * ordered[-1]:7.2f} ms  (mean {1000 * sum(ordered) / len(ordered):.2f} ms,"
        f" n={len(ordered)})"
    )


def cpu_line(meter: CpuMeter) -> str:
    _, other, by_name = meter.measure()
    split = ", ".join(f"{name} {value:.2f}" for name, value in sorted(by_name.items()))
    warning = f"; other processes +{other:.2f} cores: rerun" if other >= 0.1 else ""
    return f"{'':<28} CPU cores: {split}{warning}"


def bench_steward(args: argparse.Namespace, root: Path) -> list[str]:
    with Procs(root / "logs" / "steward") as procs:
        cluster = start_steward(
            procs,
            root / "steward-data",
            workers=2,
            slots=args.steward_slots,
            task_isolation=args.task_isolation,
        )
        with RawHttp(cluster.port, timeout_s=WAIT_S + 30) as http:
            submit = http.build(
                "POST", "/api/v1/tasks", b'{"type":"noop","tenant":"bench","params":null}'
            )

            def one() -> float:
                started = time.perf_counter()
                status, body = http.send_raw(submit)
                submitted = time.perf_counter() - started
                if status != 201:
                    raise RuntimeError(f"submit: HTTP {status}: {body[:200]!r}")
                task_id = json.loads(body)["id"]
                wait = http.build("GET", f"/api/v1/tasks/{task_id}?wait_s={WAIT_S:g}")
                for _ in range(3):
                    status, body = http.send_raw(wait)
                    state = json.loads(body)["state"] if status == 200 else f"HTTP {status}"
                    if state == "finished":
                        return submitted
                    if state in ("error", "cancelled") or status != 200:
                        raise RuntimeError(f"task {task_id}: {state}: {body[:200]!r}")
                raise TimeoutError(f"task {task_id} not finished within {3 * WAIT_S:g} s")

            meter = CpuMeter(procs)
            totals, submits = closed_loop(one, args.n, args.warmup, args.max_s)
            lines = [
                line("steward submit+result", totals),
                line("steward submit ack alone", submits),
                cpu_line(meter),
            ]
            if args.profile is not None:
                targets = [("broker", cluster.broker.pid), ("worker1", cluster.workers[0].pid)]
                with Profiler(args.profile).recording(targets, "roundtrip"):
                    totals, _ = closed_loop(one, args.n, 0, args.max_s)
                lines.append(line("steward under py-spy --gil", totals))
                for name, _pid in targets:
                    path = args.profile / f"roundtrip-{name}.txt"
                    lines += [f"py-spy {name} ({path}):", summarise_profile(path)]
    return lines


def bench_celery(args: argparse.Namespace, root: Path) -> list[str]:
    from bench_peers.celery_app import TASK_NAME, make_app

    with Procs(root / "logs" / "celery") as procs:
        server = start_redis(procs, root / "redis-celery", durable=False)
        env = child_env({"BENCH_REDIS_URL": server.url})
        for i in (1, 2):
            procs.start(
                f"celery-worker-{i}",
                [
                    *CELERY_WORKER_ARGV,
                    "-P",
                    "threads",
                    "-c",
                    str(args.peer_threads),
                    "-n",
                    f"bench{i}@%h",
                ],
                env=env,
            )
        app = make_app(server.url)
        noop = app.tasks[TASK_NAME]
        try:
            # Start-up: the first task waits for a worker to come up.
            noop.delay().get(timeout=120)

            def one() -> None:
                noop.delay().get(timeout=WAIT_S)

            meter = CpuMeter(procs)
            totals, _ = closed_loop(one, args.n, args.warmup, args.max_s)
            cpu = cpu_line(meter)
        finally:
            app.close()
    return [line("celery delay().get()", totals), cpu]


def bench_dramatiq(args: argparse.Namespace, root: Path) -> list[str]:
    from bench_peers.dramatiq_app import make_app

    with Procs(root / "logs" / "dramatiq") as procs:
        server = start_redis(procs, root / "redis-dramatiq", durable=False)
        procs.start(
            "dramatiq-workers",
            dramatiq_workers_argv(args.peer_threads),
            env=child_env({"BENCH_REDIS_URL": server.url}),
        )
        app = make_app(server.url)
        try:
            app.noop.send().get_result(backend=app.backend, block=True, timeout=120_000)

            def one() -> None:
                message = app.noop.send()
                message.get_result(backend=app.backend, block=True, timeout=int(WAIT_S * 1000))

            meter = CpuMeter(procs)
            totals, _ = closed_loop(one, args.n, args.warmup, args.max_s)
            cpu = cpu_line(meter)
        finally:
            app.broker.close()
    return [line("dramatiq send().get_result()", totals), cpu]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2_000, help="timed round trips")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--systems", default="steward,celery,dramatiq")
    parser.add_argument("--steward-slots", type=int, default=64, help="noop slots per worker")
    parser.add_argument("--peer-threads", type=int, default=8)
    parser.add_argument(
        "--task-isolation",
        choices=("process", "thread"),
        default="process",
        help="Steward workers run tasks in task processes (default) or in the worker",
    )
    parser.add_argument("--max-s", type=float, default=300.0, help="bound per system")
    add_run_dir_options(
        parser,
        profile_help="then n more Steward round trips under py-spy (broker, worker 1), summarised",
    )
    args = parse_run_args(parser)
    systems = available_systems(args.systems)
    print(
        f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, steward "
        f"{source_revision()}; one client, "
        f"closed loop, {args.n:,} round trips after {args.warmup} warm-up, 2 worker processes"
    )
    benches = {"steward": bench_steward, "celery": bench_celery, "dramatiq": bench_dramatiq}
    with tempfile.TemporaryDirectory(prefix="steward-rt-", dir=args.data_root) as tmp:
        for system in systems:
            try:
                for text in benches[system](args, Path(tmp)):
                    print(text, flush=True)
            except (TimeoutError, RuntimeError, OSError) as exc:
                print(f"{system:<28} FAILED: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
