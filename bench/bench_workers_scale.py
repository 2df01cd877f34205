"""One leader, many workers: what each connected worker costs a standalone broker.

Starts a real ``steward standalone`` subprocess (file ledger, fsync group commit) and
connects N workers to it from this one process, each a TCP connection speaking the real
worker protocol (wire/worker_protocol.py) with one slot, heartbeating at the interval
its Welcome names and finishing every task the moment it is assigned. For each N it
measures, on the broker process (/proc/<pid>/stat and /proc/<pid>/status):

- connect: all N connect (at most ``--connect-window`` handshakes in flight), seconds until
  the last Welcome;
- memory per worker: the broker's RSS after connecting minus before, over N;
- idle CPU: the broker's CPU over ``--idle-seconds`` with every worker heartbeating and
  no task, as a fraction of one core;
- assignments: ``--tasks`` no-op tasks submitted over HTTP in batches, each finished on
  assignment: tasks per second (first submit to last FinishAck) and broker CPU per task
  (submit, placement, scheduling, assign, finish, acknowledge), also net of the idle
  (heartbeat) CPU measured before over the same time;
- reconnect storm: every connection dropped at once, then every worker reconnecting at
  once (as after a leader change): seconds until all are welcomed again, and how many
  handshakes the broker refused (a refused worker retries after 50-250 ms).

Prints a Markdown table; asserts nothing about timing.

    python bench/bench_workers_scale.py                      # N = 100, 1000, 5000, 10000
    python bench/bench_workers_scale.py --workers 100,1000 --tasks 5000
    python bench/bench_workers_scale.py --workers 10000 --profile /tmp/prof  # py-spy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_peers.harness import free_port, standalone_argv

from wire import worker_protocol as p

TICK_S = 0.05  # the fleet's heartbeat timer
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def raise_fd_limit(needed: int) -> None:
    """Each worker is one descriptor here and one in the broker (which inherits this)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise SystemExit(f"need {needed} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES


# --- the workers ---------------------------------------------------------------------------


class Fleet:
    """Every fake worker's connection state; the counters the measurements read."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.ids = [f"w{i:05d}" for i in range(count)]
        self.links: dict[str, WorkerConnection] = {}
        self.welcomed = 0
        self.refused: dict[str, int] = {}
        self.finished = 0  # FinishAcks received (tasks)
        self.assigned = 0
        self.intervals: dict[int, int] = {}  # Welcome's heartbeat interval (ms) -> workers
        self.all_welcomed = asyncio.Event()
        self.target = count

    def welcome(self, link: WorkerConnection, welcome: p.Welcome) -> None:
        # Each beats at the interval its own Welcome named, from a random phase.
        link.every = max(1, round(welcome.heartbeat_interval_ms / 1000 / TICK_S))
        link.phase = random.randrange(link.every)
        self.intervals[welcome.heartbeat_interval_ms] = (
            self.intervals.get(welcome.heartbeat_interval_ms, 0) + 1
        )
        self.welcomed += 1
        if self.welcomed >= self.target:
            self.all_welcomed.set()


class WorkerConnection(asyncio.Protocol):
    """One worker: Hello, then heartbeats (from the fleet's timer) and finish on assign."""

    def __init__(self, fleet: Fleet, worker_id: str, done: asyncio.Future[str]) -> None:
        self.fleet = fleet
        self.worker_id = worker_id
        self.decoder = p.FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.ready = False
        self.done = done  # "ok" after the Welcome, or the refusal code
        self.seq = 0
        self.every = 1  # beats every this many ticks
        self.phase = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        transport.write(  # type: ignore[attr-defined]
            p.encode_message(
                p.Hello(
                    worker_id=self.worker_id,
                    process_id="bench-" + self.worker_id,
                    version="bench",
                    task_types={"*": 1},
                )
            )
        )

    def data_received(self, data: bytes) -> None:
        for message in self.decoder.feed(data):
            if isinstance(message, p.Assign):
                self.fleet.assigned += len(message.tasks)
                self.send(
                    p.Finish(
                        reports=tuple(
                            p.TaskReport(task_id=t.task_id, attempt=t.attempt, ok=True)
                            for t in message.tasks
                        )
                    )
                )
            elif isinstance(message, p.FinishAck):
                self.fleet.finished += len(message.tasks)
            elif isinstance(message, p.Welcome):
                self.ready = True
                self.fleet.links[self.worker_id] = self
                self.fleet.welcome(self, message)
                if not self.done.done():
                    self.done.set_result("ok")
            elif isinstance(message, p.Error) and not self.done.done():
                self.done.set_result(message.code)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ready = False
        if self.fleet.links.get(self.worker_id) is self:
            del self.fleet.links[self.worker_id]
        if not self.done.done():
            self.done.set_result("closed")

    def send(self, message: p.Message) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(p.encode_message(message))

    def beat(self) -> None:
        self.seq += 1
        self.send(p.Heartbeat(seq=self.seq))


async def connect_one(fleet: Fleet, worker_id: str, retry: bool) -> None:
    """Connect until welcomed. A refusal retries when ``retry``, as ``steward worker``
    does: after a jittered backoff from 0.1 s doubling up to 5 s (clients/worker/config.py)."""
    loop = asyncio.get_running_loop()
    backoff_s = 0.1
    while True:
        done: asyncio.Future[str] = loop.create_future()
        try:
            await loop.create_connection(
                functools.partial(WorkerConnection, fleet, worker_id, done),
                "127.0.0.1",
                fleet.port,
            )
            outcome = await asyncio.wait_for(done, 60)
        except (OSError, TimeoutError) as exc:
            outcome = type(exc).__name__
        if outcome == "ok":
            return
        fleet.refused[outcome] = fleet.refused.get(outcome, 0) + 1
        if not retry:
            raise SystemExit(f"{worker_id} refused: {outcome}")
        await asyncio.sleep(random.uniform(backoff_s / 2, backoff_s))
        backoff_s = min(backoff_s * 2, 5.0)


async def connect_all(fleet: Fleet, window: int, retry: bool) -> float:
    """Connect every worker, at most ``window`` at a time (0: all at once); seconds."""
    fleet.welcomed = 0
    fleet.all_welcomed = asyncio.Event()
    started = time.perf_counter()
    if window <= 0:
        await asyncio.gather(*(connect_one(fleet, w, retry) for w in fleet.ids))
    else:
        gate = asyncio.Semaphore(window)

        async def gated(worker_id: str) -> None:
            async with gate:
                await connect_one(fleet, worker_id, retry)

        await asyncio.gather(*(gated(w) for w in fleet.ids))
    return time.perf_counter() - started


async def heartbeats(fleet: Fleet) -> None:
    """Each welcomed worker beats once per its interval, at its own phase (as
    independently started workers would)."""
    index = 0
    while True:
        await asyncio.sleep(TICK_S)
        index += 1
        for link in list(fleet.links.values()):
            if (index - link.phase) % link.every == 0:
                link.beat()


# --- the broker ------------------------------------------------------------------------------


def start_broker(data_dir: Path, http_port: int, worker_port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            *standalone_argv(data_dir, http_port),
            "--worker-listen",
            f"127.0.0.1:{worker_port}",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"broker exited with {proc.returncode}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1),
        ):
            return proc
        time.sleep(0.1)
    stop(proc)
    raise SystemExit("broker did not become ready within 60 s")


def start_profiler(pid: int, path: str) -> subprocess.Popen[bytes]:
    """py-spy on the broker, raw samples to ``path`` until SIGINT."""
    py_spy = "py-spy" if shutil.which("py-spy") else "/work/venv/bin/py-spy"
    return subprocess.Popen(
        [py_spy, "record", "-r", "1000", "-f", "raw", "-o", path, "-p", str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def submit(http_port: int, count: int, batch: int) -> None:
    """Submit ``count`` no-op tasks, ``batch`` per request (one HTTP connection)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    try:
        task = '{"type":"noop","tenant":"bench","params":null}'
        left = count
        while left > 0:
            n = min(batch, left)
            body = ('{"tasks":[' + ",".join([task] * n) + "]}").encode()
            conn.request("POST", "/api/v1/tasks", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            text = answer.read()
            if answer.status >= 300:
                raise SystemExit(f"submit failed: {answer.status} {text[:200]!r}")
            left -= n
    finally:
        conn.close()


# --- one size ---------------------------------------------------------------------------------


@dataclass
class Row:
    workers: int
    connect_s: float = 0.0
    rss_per_worker_kb: float = 0.0
    idle_core: float = 0.0
    tasks_per_s: float = 0.0
    cpu_ms_per_1000: float = 0.0
    net_ms_per_1000: float = 0.0  # less the idle (heartbeat) CPU over the same time
    storm_s: float = 0.0
    storm_refused: dict[str, int] = field(default_factory=dict)
    idle_after_storm: float = 0.0
    rss_end_mb: float = 0.0  # the broker's RSS at the end (tasks and the storm done)


async def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not within {timeout_s:.0f} s")
        await asyncio.sleep(0.02)


async def measure(args: argparse.Namespace, count: int) -> Row:
    row = Row(count)
    data_dir = Path(tempfile.mkdtemp(prefix="steward-wscale-"))
    http_port, worker_port = free_port(), free_port()
    proc = start_broker(data_dir, http_port, worker_port)
    profiler: subprocess.Popen[bytes] | None = None
    fleet = Fleet(worker_port, count)
    beats: asyncio.Task[None] | None = None
    try:
        await asyncio.sleep(1.0)  # let startup settle
        rss_before = rss_bytes(proc.pid)
        beats = asyncio.create_task(heartbeats(fleet))  # the welcomed ones beat at once
        row.connect_s = await connect_all(fleet, args.connect_window, retry=False)
        await asyncio.sleep(2.0)
        row.rss_per_worker_kb = (rss_bytes(proc.pid) - rss_before) / count / 1024
        print(f"  N={count}: connected in {row.connect_s:.2f} s", flush=True)

        cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
        await asyncio.sleep(args.idle_seconds)
        row.idle_core = (cpu_s(proc.pid) - cpu0) / (time.perf_counter() - t0)
        print(f"  N={count}: idle {row.idle_core:.1%} of a core", flush=True)

        if args.profile:
            profiler = start_profiler(proc.pid, f"{args.profile}-{count}.txt")
            await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        goal = fleet.finished + args.tasks
        cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
        await loop.run_in_executor(None, submit, http_port, args.tasks, args.batch)
        await wait_for(lambda: fleet.finished >= goal, 300, f"{args.tasks} tasks finished")
        elapsed = time.perf_counter() - t0
        busy_s = cpu_s(proc.pid) - cpu0
        row.cpu_ms_per_1000 = busy_s * 1000 / args.tasks * 1000
        row.net_ms_per_1000 = (busy_s - row.idle_core * elapsed) * 1000 / args.tasks * 1000
        row.tasks_per_s = args.tasks / elapsed
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(timeout=60)
            profiler = None
        print(
            f"  N={count}: {row.tasks_per_s:,.0f} tasks/s, "
            f"{row.cpu_ms_per_1000:.0f} ms broker CPU per 1,000 "
            f"({row.net_ms_per_1000:.0f} ms net of heartbeats)",
            flush=True,
        )

        # Reconnect storm: all drop at once, all come back at once.
        for link in list(fleet.links.values()):
            assert link.transport is not None
            link.transport.abort()
        await wait_for(lambda: not fleet.links, 30, "every connection dropped")
        fleet.refused = {}
        fleet.intervals = {}
        row.storm_s = await asyncio.wait_for(connect_all(fleet, 0, retry=True), 300)
        row.storm_refused = dict(fleet.refused)
        print(f"  N={count}: storm {row.storm_s:.2f} s, refused {row.storm_refused}", flush=True)
        # Idle again: every worker now got its Welcome from a broker that knew them all.
        await asyncio.sleep(2.0)
        if args.profile:  # the idle broker: heartbeats only
            profiler = start_profiler(proc.pid, f"{args.profile}-{count}-idle.txt")
            await asyncio.sleep(1.0)
        cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
        await asyncio.sleep(args.idle_seconds)
        row.idle_after_storm = (cpu_s(proc.pid) - cpu0) / (time.perf_counter() - t0)
        row.rss_end_mb = rss_bytes(proc.pid) / 2**20
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(timeout=60)
            profiler = None
        print(
            f"  N={count}: idle after the storm {row.idle_after_storm:.1%}; "
            f"Welcome intervals (ms: workers) {sorted(fleet.intervals.items())}",
            flush=True,
        )
    finally:
        if beats is not None:
            beats.cancel()
        for link in list(fleet.links.values()):
            if link.transport is not None:
                link.transport.abort()
        if profiler is not None:
            profiler.kill()
            profiler.wait()
        stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
    return row


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| workers | connect s | broker RSS per worker | idle broker CPU (heartbeats) "
        "| tasks/s | broker CPU per 1,000 tasks (net of heartbeats) | reconnect storm s "
        "| storm refusals | idle after storm | broker RSS at the end |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r.storm_refused.items())) or "none"
        lines.append(
            f"| {r.workers:,} | {r.connect_s:.2f} | {r.rss_per_worker_kb:.1f} KB "
            f"| {r.idle_core:.1%} | {r.tasks_per_s:,.0f} "
            f"| {r.cpu_ms_per_1000:.0f} ms ({r.net_ms_per_1000:.0f} ms) "
            f"| {r.storm_s:.2f} | {refused} | {r.idle_after_storm:.1%} | {r.rss_end_mb:.0f} MB |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="100,1000,5000,10000", help="comma-separated N")
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per size")
    parser.add_argument("--batch", type=int, default=500, help="tasks per submit request")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument(
        "--connect-window", type=int, default=32, help="handshakes in flight when connecting"
    )
    parser.add_argument("--profile", default="", help="py-spy raw profiles to PREFIX-N.txt")
    return parser.parse_args(argv)


async def amain(args: argparse.Namespace) -> list[Row]:
    rows = []
    for count in (int(n) for n in args.workers.split(",")):
        rows.append(await measure(args, count))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = [int(n) for n in args.workers.split(",")]
    raise_fd_limit(max(sizes) + 1024)
    print(
        f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{args.tasks:,} tasks per size in batches of {args.batch}",
        flush=True,
    )
    rows = uvloop.run(amain(args))
    print(table(rows))
    print(json.dumps([r.__dict__ for r in rows]))


if __name__ == "__main__":
    main()
