"""Process, HTTP and Redis plumbing shared by bench_e2e.py and bench_roundtrip.py.

Everything binds to 127.0.0.1. Every process started here is registered with a
:class:`Procs` and stopped by its pid (SIGTERM, then SIGKILL after a bound) together with
the children it forked, even when the benchmark fails or is interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = BENCH_DIR.parent

INSTALL_HINT = (
    "to run the Celery/Dramatiq/RQ comparison install the peers:\n"
    "    apt-get update && apt-get install -y redis-server\n"
    "    .venv/bin/pip install 'celery[redis]>=5.4,<6' 'dramatiq[redis]>=1.17' 'rq>=2.12,<3'"
)
# The pip requirement of each peer (none is a project dependency).
PEER_PACKAGES = {
    "celery": "celery[redis]>=5.4,<6",
    "dramatiq": "dramatiq[redis]>=1.17",
    "rq": "rq>=2.12,<3",
}


# --- small helpers -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, int(fraction * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if predicate():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready within {timeout_s:.0f} s")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for children: bench/ (for bench_peers) and the repo on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(BENCH_DIR), str(REPO_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def source_revision() -> str:
    """``git describe`` of the Steward tree being measured (``-dirty`` with local edits)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


def available_systems(systems_arg: str) -> list[str]:
    """The systems named in ``--systems`` (comma-separated) that can run here.

    A peer whose server (redis-server) or Python package is not installed is dropped,
    with what is missing and how to install it printed; Steward always stays.
    """
    systems = [s.strip() for s in systems_arg.split(",") if s.strip()]
    unknown = [s for s in systems if s != "steward" and s not in PEER_PACKAGES]
    if unknown:
        choices = ",".join(["steward", *PEER_PACKAGES])
        raise SystemExit(f"unknown systems {unknown}: choose from {choices}")
    peers = [s for s in systems if s != "steward"]
    if peers and shutil.which("redis-server") is None:
        print(f"peers skipped, missing: redis-server\n{INSTALL_HINT}\n")
        return [s for s in systems if s == "steward"]
    kept = []
    for system in systems:
        missing = [m for m in (system, "redis") if importlib.util.find_spec(m) is None]
        if system != "steward" and missing:
            print(
                f"{system} skipped, python package {' and '.join(missing)} not installed: "
                f".venv/bin/pip install '{PEER_PACKAGES[system]}'"
            )
            continue
        kept.append(system)
    return kept


def on_signals_exit() -> None:
    """SIGTERM/SIGHUP raise SystemExit so that every ``finally`` (process cleanup) runs."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


def add_run_dir_options(parser: argparse.ArgumentParser, *, profile_help: str) -> None:
    """--data-root and --profile, the same in every benchmark that starts servers."""
    parser.add_argument("--data-root", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR", help=profile_help)


def parse_run_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse, create the profile directory (fail early, before any run), handle signals."""
    args = parser.parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    on_signals_exit()
    return args


# --- CPU accounting: is something else loading the machine? ----------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its reaped children (0 if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in stat[11:15]) / _TICKS  # utime stime cutime cstime


def _user_processes_cpu_s(exclude: set[int]) -> dict[int, float]:
    """CPU seconds of every user-space process (not kernel threads) outside ``exclude``.

    Own time only (utime + stime): a parent's reaped-children time arrives all at once
    when a child exits, whole lifetime included, and counted several cores' worth on a
    2-core machine. A process that starts and ends between two samples is missed.
    """
    found: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[1] == "2" or entry.name == "2":  # kthreadd and its kernel threads
            continue
        found[int(entry.name)] = sum(int(v) for v in stat[11:13]) / _TICKS
    return found


class CpuMeter:
    """Cores used by this benchmark's processes and by other processes over an interval.

    "Other" counts user-space processes outside this benchmark (another test run, say);
    kernel work (loopback softirqs, journal commits for fsync) is not counted anywhere.
    """

    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self._start = self._sample()

    def _ours(self) -> dict[tuple[str, int], float]:
        """CPU seconds per (process name, pid): the client, each process and its children."""
        pids = {("client", os.getpid())}
        for proc in self.procs.procs:
            pids.add((proc.name, proc.pid))
            pids.update((proc.name, pid) for pid, _ in _descendants(proc.pid))
        return {key: _process_cpu_s(key[1]) for key in pids}

    def _sample(self) -> tuple[float, dict[int, float], dict[tuple[str, int], float]]:
        ours = self._ours()
        others = _user_processes_cpu_s({pid for _, pid in ours})
        return time.perf_counter(), others, ours

    def restart(self) -> None:
        self._start = self._sample()

    def measure(self) -> tuple[float, float, dict[str, float]]:
        """(our cores, other processes' cores, our cores by process name) since the start."""
        t0, others0, ours0 = self._start
        t1, others1, ours1 = self._sample()
        elapsed = max(1e-9, t1 - t0)
        by_name: dict[str, float] = {}
        for key, value in ours1.items():
            by_name[key[0]] = by_name.get(key[0], 0.0) + (value - ours0.get(key, 0.0)) / elapsed
        other = sum(max(0.0, v - others0.get(pid, 0.0)) for pid, v in others1.items())
        return sum(by_name.values()), other / elapsed, by_name


# --- processes ---------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/pid/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``pid``, children first."""
    found: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    started = _start_time(int(child))
                    if started is not None:
                        found.append((int(child), started))
                        todo.append(int(child))
    return found


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])


@dataclass
class Procs:
    """Processes started by the benchmark; :meth:`stop_all` ends them by pid."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_DIR,
                env=env or child_env(),
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        for proc in self.procs:
            code = proc.popen.poll()
            if code is not None:
                raise RuntimeError(
                    f"{proc.name} (pid {proc.pid}) exited with {code}:\n{proc.tail()}"
                )

    def stop(self, proc: Proc, timeout_s: float = 20.0) -> None:
        family = _descendants(proc.pid) if proc.popen.poll() is None else []
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.kill()
                proc.popen.wait(timeout=10)
        # Children the process forked and left behind: only if still the same process.
        for pid, started in family:
            if _start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ValueError):
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            try:
                self.stop(proc)
            except Exception as exc:  # keep cleaning up the others
                print(f"warning: stopping {proc.name} (pid {proc.pid}): {exc}", file=sys.stderr)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_all()


# --- a lean blocking HTTP/1.1 keep-alive client ------------------------------------------------


class RawHttp:
    """One keep-alive connection; requests are written as pre-built bytes where possible."""

    def __init__(self, port: int, timeout_s: float = 30.0) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawHttp:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def build(self, method: str, path: str, body: bytes | None = None) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode() + (body or b"")

    def send_raw(self, request: bytes) -> tuple[int, bytes]:
        self.sock.sendall(request)
        return self._read_response()

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        return self.send_raw(self.build(method, path, body))

    def json(self, method: str, path: str, body: bytes | None = None) -> Any:
        status, data = self.request(method, path, body)
        if status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(262144)
        if not chunk:
            raise ConnectionError("connection closed by the server")
        self.buf += chunk

    def _read_response(self) -> tuple[int, bytes]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        head = bytes(self.buf[:end])
        status = int(head[9:12])
        length = -1
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length < 0:
            raise RuntimeError(f"response without Content-Length: {head!r}")
        start = end + 4
        while len(self.buf) < start + length:
            self._fill()
        body = bytes(self.buf[start : start + length])
        del self.buf[: start + length]
        return status, body


# --- Steward -----------------------------------------------------------------------------------


@dataclass
class StewardCluster:
    port: int
    worker_port: int
    broker: Proc
    workers: list[Proc]

    def counts(self, http: RawHttp) -> dict[str, int]:
        counts: dict[str, int] = http.json("GET", "/api/v1/cluster")["tasks"]
        return counts


def standalone_argv(data_dir: Path, port: int) -> list[str]:
    """`steward standalone` with its data in ``data_dir`` and its API on 127.0.0.1:``port``."""
    return [
        sys.executable,
        "-m",
        "clients.cli",
        "standalone",
        "--data-dir",
        str(data_dir),
        "--http",
        f"127.0.0.1:{port}",
    ]


def start_steward(
    procs: Procs,
    data_dir: Path,
    *,
    workers: int,
    slots: int,
    ready_timeout_s: float = 120.0,
    task_isolation: str = "process",
) -> StewardCluster:
    """A standalone broker (durable file ledger) and ``workers`` worker processes.

    ``task_isolation``: where the workers run tasks ("process": task processes, the
    default; "thread": in the worker process).
    """
    port, worker_port = free_port(), free_port()
    broker = procs.start(
        "steward-broker",
        [
            *standalone_argv(data_dir, port),
            "--worker-listen",
            f"127.0.0.1:{worker_port}",
            "--log-level",
            "WARNING",
        ],
    )

    def healthy() -> bool:
        procs.check_alive()
        with RawHttp(port, timeout_s=2) as http:
            return http.request("GET", "/healthz")[0] == 200

    wait_until(healthy, ready_timeout_s, "steward broker")
    started = [
        procs.start(
            f"steward-worker-{i}",
            [
                sys.executable,
                "-m",
                "clients.cli",
                "worker",
                "--broker",
                f"127.0.0.1:{worker_port}",
                "--http-url",
                f"http://127.0.0.1:{port}",
                "--worker-id",
                f"bench-w{i}",
                "--task-type",
                f"noop={slots}",
                "--task-isolation",
                task_isolation,
                "--log-level",
                "WARNING",
            ],
        )
        for i in range(1, workers + 1)
    ]

    def connected() -> bool:
        procs.check_alive()
        with RawHttp(port, timeout_s=2) as http:
            summary = http.json("GET", "/api/v1/cluster")
        live = [w for w in summary["workers"] if w["state"] == "connected"]
        return len(live) >= workers

    wait_until(connected, ready_timeout_s, f"{workers} steward workers")
    return StewardCluster(port, worker_port, broker, started)


# --- Redis -------------------------------------------------------------------------------------


@dataclass
class Redis:
    url: str
    port: int
    proc: Proc
    durable: bool


def start_redis(procs: Procs, data_dir: Path, *, durable: bool, name: str = "redis") -> Redis:
    """redis-server on a free loopback port; durable = AOF with fsync before every reply."""
    import redis

    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else []
    proc = procs.start(
        name,
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            *persistence,
            "--dir",
            str(data_dir),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ],
    )
    url = f"redis://127.0.0.1:{port}/0"

    def ping() -> bool:
        procs.check_alive()
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    wait_until(ping, 30, "redis-server")
    return Redis(url, port, proc, durable)


def redis_version() -> str:
    try:
        out = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return "?"


def keys_present_from(client: Any, keys: Sequence[str], start: int, chunk: int = 1000) -> int:
    """Index of the first key at or after ``start`` that does not exist yet (len: all do).

    One EXISTS over a whole chunk when it is complete; a pipelined EXISTS per key only
    for the chunk where the first missing key is. Tasks end roughly in submission order,
    so over a run every key is checked about once.
    """
    index = start
    while index < len(keys):
        part = keys[index : index + chunk]
        if client.exists(*part) == len(part):
            index += len(part)
            continue
        pipe = client.pipeline(transaction=False)
        for key in part:
            pipe.exists(key)
        for found in pipe.execute():
            if not found:
                return index
            index += 1
    return index


# --- py-spy ------------------------------------------------------------------------------------


@dataclass
class Profiler:
    """``py-spy record --format raw`` of some pids while a block runs; summarised after."""

    out_dir: Path
    rate: int = 250
    running: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    @contextlib.contextmanager
    def recording(self, targets: Sequence[tuple[str, int]], label: str) -> Iterator[None]:
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in targets:
            path = self.out_dir / f"{label}-{name}.txt"
            popen = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--rate",
                    str(self.rate),
                    "--nonblocking",
                    "--gil",  # only threads holding the GIL: where Python CPU time goes
                    "--output",
                    str(path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.running.append((name, popen, path))
        try:
            yield
        finally:
            for _name, popen, _path in self.running:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            for _name, popen, _path in self.running:
                try:
                    popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(timeout=10)
            self.running.clear()


def summarise_profile(path: Path, top: int = 12) -> str:
    """Self and inclusive % of samples per function from a py-spy raw (collapsed) file."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        return f"  (no profile: {exc})"
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short_frame(f) for f in stack.split(";") if f]
        # py-spy puts the thread name first: drop it.
        if frames and frames[0].startswith(("thread ", "process ")):
            frames = frames[1:]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    if not total:
        return "  (no samples)"
    rows = [f"  {total} samples holding the GIL; self %:"]
    for frame, count in self_counts.most_common(top):
        rows.append(f"  {100 * count / total:5.1f}%  {frame}")
    rows.append("  inclusive:")
    for frame, count in incl_counts.most_common(top + 8):
        rows.append(f"  {100 * count / total:5.1f}%  {frame}")
    return "\n".join(rows)


def _short_frame(frame: str) -> str:
    # "function (/long/path/to/module.py:123)" -> "function (module.py)"
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(file).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else file
    return f"{name} ({short})" if where else name


# The peers' worker command lines, the same in every benchmark.
CELERY_WORKER_ARGV = [
    sys.executable,
    "-m",
    "celery",
    "-A",
    "bench_peers.celery_app",
    "worker",
    "--loglevel",
    "WARNING",
    "--without-gossip",
    "--without-mingle",
    "--without-heartbeat",
]


def dramatiq_workers_argv(threads: int) -> list[str]:
    """Two Dramatiq worker processes of ``threads`` threads each."""
    return [
        sys.executable,
        "-m",
        "dramatiq",
        "bench_peers.dramatiq_app",
        "--processes",
        "2",
        "--threads",
        str(threads),
    ]


def rq_worker_argv(url: str, name: str, queue: str, *, simple: bool = False) -> list[str]:
    """One RQ worker on ``queue``: RQ's default forking ``Worker`` (a work horse process
    per job), or ``SimpleWorker`` (jobs run in the worker process) when ``simple``."""
    worker_class = ["--worker-class", "rq.worker.SimpleWorker"] if simple else []
    return [
        sys.executable,
        "-c",
        "import sys; from rq.cli import main; sys.exit(main())",
        "worker",
        "--url",
        url,
        "--path",
        str(BENCH_DIR),
        "--logging_level",
        "WARNING",
        "--disable-job-desc-logging",
        "--name",
        name,
        *worker_class,
        queue,
    ]
