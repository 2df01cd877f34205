"""``steward demo``: a standalone broker and a worker in a temporary data dir,
a PySpark word count over a bundled corpus for two tenants with weights 3:1."""

from __future__ import annotations

import collections
import contextlib
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
    ``say`` is told each step as it starts (the demo prints them)."""
    step = say if say is not None else (lambda _message: None)
    begun = time.monotonic()
    http_port, worker_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
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
            _wait(lambda: _healthy(client), 30, "the broker did not start")
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
                    )
                )
            _wait(lambda: _connected_workers(client) >= workers, 60, "the worker did not connect")
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


def _wait(check: Any, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{message} within {timeout_s:.0f} s")


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
                    raise RuntimeError(f"task {task['id']} {task['state']}: {task.get('error')}")
                counts[tenant].update(task["result"]["counts"])
                if not remaining:
                    finished_s[tenant] = time.monotonic() - started
                    del pending[tenant]
    return {"counts": counts, "finished_s": finished_s, "tasks": total, "artifact": sha}


def _task_process_problem() -> str | None:
    """What would stop the demo's workers from running tasks (say it now, not after 60 s)."""
    from clients.worker.config import WorkerConfig
    from clients.worker.task_procs import check_task_processes

    try:
        check_task_processes(WorkerConfig(broker="127.0.0.1:1", http_url="http://127.0.0.1:1"))
    except ValueError as exc:
        return str(exc)
    return None


def _say(message: str) -> None:
    print(message, flush=True)


def run_demo(keep: bool = False) -> int:
    data_root = Path(tempfile.mkdtemp(prefix="steward-demo-"))
    lines = corpus_lines()
    print(f"steward demo: data dir {data_root}")
    print(f"corpus: {len(lines):,} lines; tenants and weights: {TENANT_WEIGHTS}")
    problem = _task_process_problem()
    if problem is not None:
        print(f"steward demo: {problem}", file=sys.stderr)
        return 2
    try:
        _say("starting a standalone broker ...")
        with local_cluster(data_root / "data", log=data_root / "demo.log", say=_say) as url:
            _say("uploading the word-count job and submitting the corpus ...")
            with StewardClient(url) as client:
                outcome = run_wordcount(client, lines, say=_say)
        expected = plain_python_count(lines)
        print(f"{outcome['tasks']} tasks on artifact {outcome['artifact'][:12]}")
        for tenant, seconds in outcome["finished_s"].items():
            print(
                f"tenant {tenant:<10} weight {TENANT_WEIGHTS[tenant]:.0f}: done in {seconds:.1f} s"
            )
        for tenant, counts in outcome["counts"].items():
            if counts != expected:
                print(f"MISMATCH: {tenant}'s count differs from plain Python", file=sys.stderr)
                return 1
        print("both tenants' counts equal a plain-Python count of the corpus")
        print("top words:")
        for word, n in expected.most_common(10):
            print(f"  {word:<12} {n}")
        return 0
    finally:
        if not keep:
            shutil.rmtree(data_root, ignore_errors=True)
