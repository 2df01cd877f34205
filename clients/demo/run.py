"""``steward demo``: a standalone broker and a worker in a temporary data dir,
a PySpark word count over a bundled corpus for two tenants with weights 3:1."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from clients.client import StewardClient, StewardError, TaskHandle
from clients.demo.wordcount_job import words_of
from clients.progress import PIPE_INTERVAL_S, Progress
from clients.worker.config import PARENT_PID_ENV, WorkerConfig

TENANT_WEIGHTS = {"analytics": 3.0, "adhoc": 1.0}
LINES_PER_TASK = 250
JOB_TYPE = "wordcount_job:count_words"


def corpus_lines() -> list[str]:
    text = resources.files("clients.demo").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def plain_python_count(lines: list[str]) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        counts.update(words_of(line))
    return counts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def local_cluster(
    data_dir: Path,
    *,
    workers: int = 1,
    log: Path | None = None,
    worker_args: Sequence[str] = (),
    say: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """A standalone broker and worker processes (``worker_args`` added); yields the broker URL.
    ``say`` is told each step as it starts (the demo prints them). ClusterStartError, with
    the cause the process logged, when a process exits while starting or one does not
    start in time.

    Each worker's default work dir carries this process's pid (as a standalone broker's
    workers carry its pid), so another demo, or a worker of the same id, on the host is no
    clash; the worker removes it when it exits cleanly."""
    step = say if say is not None else (lambda _message: None)
    begun = time.monotonic()
    http_port, worker_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    worker_env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    try:
        procs.append(
            subprocess.Popen(
                [
                    *_steward(),
                    "standalone",
                    "--data-dir",
                    str(data_dir),
                    "--http",
                    f"127.0.0.1:{http_port}",
                    "--worker-listen",
                    f"127.0.0.1:{worker_port}",
                    "--log-level",
                    "WARNING",
                ],
                stdout=out,
                stderr=out,
            )
        )
        with StewardClient(url, timeout_s=5) as client:
            _wait(lambda: _healthy(client), 30, "the broker did not start", procs, log)
            step(
                f"broker ready at {url} ({time.monotonic() - begun:.1f} s); starting"
                f" {workers} worker{'s' if workers != 1 else ''} ..."
            )
            for n in range(workers):
                procs.append(
                    subprocess.Popen(
                        [
                            *_steward(),
                            "worker",
                            "--broker",
                            f"127.0.0.1:{worker_port}",
                            "--http-url",
                            url,
                            "--worker-id",
                            f"demo-worker-{n + 1}",
                            # Four slots: enough for 3:1 weights to show (2 would split 1:1).
                            "--task-type",
                            "*=4",
                            "--log-level",
                            "WARNING",
                            *worker_args,
                        ],
                        stdout=out,
                        stderr=out,
                        env=worker_env,
                    )
                )
            _wait(
                lambda: _connected_workers(client) >= workers,
                60,
                "the worker did not connect",
                procs,
                log,
            )
            step(f"worker connected ({time.monotonic() - begun:.1f} s)")
        yield url
    finally:
        for proc in reversed(procs):
            _stop(proc)
        if log is not None and not isinstance(out, int):
            out.close()


def _steward() -> list[str]:
    return [sys.executable, "-m", "clients.cli"]


def _healthy(client: StewardClient) -> bool:
    try:
        client.health()
        return True
    except StewardError:
        return False


def _connected_workers(client: StewardClient) -> int:
    return sum(1 for w in client.cluster()["workers"] if w["state"] == "connected")


class ClusterStartError(RuntimeError):
    """A process of the local cluster exited while starting, or one did not start in time."""


def _wait(
    check: Callable[[], bool],
    timeout_s: float,
    message: str,
    procs: Sequence[subprocess.Popen[bytes]],
    log: Path | None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        for proc in procs:
            if proc.poll() is not None:
                raise ClusterStartError(
                    f"{message}: {_process_name(proc)} exited with code {proc.returncode}"
                    + _logged_cause(log)
                )
        time.sleep(0.1)
    raise ClusterStartError(f"{message} within {timeout_s:.0f} s" + _logged_cause(log))


def _process_name(proc: subprocess.Popen[bytes]) -> str:
    args = [str(arg) for arg in proc.args] if isinstance(proc.args, list) else []
    if "worker" in args:
        return (
            f"the worker {args[args.index('--worker-id') + 1]}"
            if "--worker-id" in args
            else "a worker"
        )
    return "the broker"


def _logged_cause(log: Path | None) -> str:
    """The last error line the processes logged (": ..."), or nothing."""
    if log is None:
        return ""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 64 * 1024))
            tail = file.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(tail):
        if "error" in line.lower():
            return f": {line.strip()}"
    return ""


class DemoTaskError(RuntimeError):
    """A task of the demo did not finish."""


def run_wordcount(
    client: StewardClient, lines: list[str], *, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Upload the job, submit the corpus per tenant, wait; returns counts and timings.
    With ``say``: the steps, a line every few seconds until the first task ends (the
    worker starts Spark meanwhile) and a progress bar (lines when piped)."""
    job = resources.files("clients.demo").joinpath("wordcount_job.py")
    with resources.as_file(job) as job_path:
        sha = client.upload_code(job_path)
    for tenant, weight in TENANT_WEIGHTS.items():
        client.set_tenant(tenant, weight=weight)
    chunks = [lines[i : i + LINES_PER_TASK] for i in range(0, len(lines), LINES_PER_TASK)]
    handles: dict[str, list[TaskHandle]] = {}
    started = time.monotonic()
    for tenant in TENANT_WEIGHTS:
        batch = [
            {"type": JOB_TYPE, "tenant": tenant, "code": sha, "params": {"lines": chunk}}
            for chunk in chunks
        ]
        submitted = client.submit_many(batch)
        errors = [r for r in submitted if isinstance(r, StewardError)]
        if errors:
            raise errors[0]
        handles[tenant] = [h for h in submitted if isinstance(h, TaskHandle)]
    total = sum(len(h) for h in handles.values())
    done = 0
    progress = Progress(total, started=started) if say is not None else None
    if say is not None:
        # No estimate: a JVM's start takes seconds on an idle machine, a minute on a busy
        # one. The time waited so far shows instead, every PIPE_INTERVAL_S.
        say(f"submitted {total} tasks; the worker is starting Spark for the first ones ...")
    last_note = started
    finished_s: dict[str, float] = {}
    counts: dict[str, collections.Counter[str]] = {t: collections.Counter() for t in handles}
    pending = {tenant: list(hs) for tenant, hs in handles.items()}
    while pending:
        for tenant in list(pending):
            remaining = pending[tenant]
            handle = remaining[0]
            task = client.task(handle.id, wait_s=0.05)
            if task["state"] in ("finished", "error", "cancelled"):
                remaining.pop(0)
                done += 1
            now = time.monotonic()
            if say is not None and done == 0 and now - last_note >= PIPE_INTERVAL_S:
                last_note = now
                say(f"  waiting for Spark on the worker ... {now - started:.0f} s")
            elif progress is not None and done > 0:
                progress.update(done)  # it prints when due: a line every few seconds piped
            if task["state"] in ("finished", "error", "cancelled"):
                if task["state"] != "finished":
                    raise DemoTaskError(f"task {task['id']} {task['state']}: {task.get('error')}")
                counts[tenant].update(task["result"]["counts"])
                if not remaining:
                    finished_s[tenant] = time.monotonic() - started
                    del pending[tenant]
    return {"counts": counts, "finished_s": finished_s, "tasks": total, "artifact": sha}


def preflight_problem() -> str | None:
    """What would stop the demo, said in its first second rather than after minutes of
    waiting (issue 30): task processes that cannot run this Python, a JVM for Spark that
    would not start. One line saying what to do, or None."""
    setup = "run ./scripts/demo from Steward's checkout, which sets this machine up, or"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return f"Spark needs Java 17 or newer and there is no java: {setup} install Java 17"
    # The probe's work dir, removed after it: the demo leaves nothing behind when it stops.
    with tempfile.TemporaryDirectory(prefix="steward-demo-check-") as scratch:
        os.chmod(scratch, 0o711)  # task users pass through to their home, as in a work dir
        config = WorkerConfig(
            broker="127.0.0.1:1", http_url="http://127.0.0.1:1", work_dir=Path(scratch) / "work"
        )
        return _task_users_problem(config, setup)


def _task_users_problem(config: WorkerConfig, setup: str) -> str | None:
    from clients.worker.spark.connect_server import spark_identity
    from clients.worker.task_env import jvm_user_name_problem
    from clients.worker.task_identity import TaskUserError
    from clients.worker.task_processes.pool import TaskProcessCheckError, check_task_processes

    try:
        check_task_processes(config)
        spark = spark_identity(config)
    except TaskProcessCheckError as exc:
        fix = (
            f"chmod o+x {' '.join(exc.closed_dirs)} (traversal only)"
            if exc.closed_dirs
            else "make the virtualenv from a Python other users can read"
            " (/usr/bin/python3 -m venv .venv)"
        )
        return (
            f"its task processes, under uids of their own (uid {exc.uid}), cannot run"
            f" {exc.python}: {exc.reason}; {setup} {fix} (docs/SECURITY.md, 'Task processes')"
        )
    except (TaskUserError, ValueError) as exc:
        return str(exc)
    jvm_problem = jvm_user_name_problem(spark.uid) if spark.switch else None
    if jvm_problem is not None:
        return (
            f"its Spark server would not start ({jvm_problem}; a JVM needs a user name):"
            f" {setup} apt-get install libnss-wrapper"
        )
    return None


def _say(message: str) -> None:
    print(message, flush=True)


def run_demo(keep: bool = False) -> int:
    problem = preflight_problem()
    if problem is not None:
        print(f"steward demo: {problem}", file=sys.stderr)
        return 2
    data_root = Path(tempfile.mkdtemp(prefix="steward-demo-"))
    lines = corpus_lines()
    print(f"steward demo: data dir {data_root}")
    print(f"corpus: {len(lines):,} lines; tenants and weights: {TENANT_WEIGHTS}")
    failed = False
    try:
        _say("starting a standalone broker ...")
        with local_cluster(data_root / "data", log=data_root / "demo.log", say=_say) as url:
            _say("uploading the word-count job and submitting the corpus ...")
            with StewardClient(url) as client:
                outcome = run_wordcount(client, lines, say=_say)
    except (ClusterStartError, StewardError, DemoTaskError) as exc:
        failed = True
        print(f"steward demo: {exc}", file=sys.stderr)
        print(f"steward demo: the log is kept: {data_root / 'demo.log'}", file=sys.stderr)
        return 1
    finally:
        if not keep and not failed:
            shutil.rmtree(data_root, ignore_errors=True)
    expected = plain_python_count(lines)
    print(f"{outcome['tasks']} tasks on artifact {outcome['artifact'][:12]}")
    for tenant, seconds in outcome["finished_s"].items():
        print(f"tenant {tenant:<10} weight {TENANT_WEIGHTS[tenant]:.0f}: done in {seconds:.1f} s")
    for tenant, counts in outcome["counts"].items():
        if counts != expected:
            print(f"MISMATCH: {tenant}'s count differs from plain Python", file=sys.stderr)
            return 1
    print("both tenants' counts equal a plain-Python count of the corpus")
    print("top words:")
    for word, n in expected.most_common(10):
        print(f"  {word:<12} {n}")
    return 0
