"""Issue 17, friction 7 ("graceful stop"): stopping a worker or a standalone broker with
running tasks says what it waits for, lets them finish within a grace and gives the rest
back to the queue, never failing them for the stop (docs/DESIGN.md §6, "Stopping").

Real processes: ``steward standalone`` and ``steward worker`` subprocesses, SIGTERM'd
as a service manager would. Every wait is bounded; every process is killed at the end.
(Friction 6, the demo's progress, is covered by tests/integration/test_readme_lines.py.)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, free_port, steward_command

GRACE_S = 5.0
# Beyond the grace: the worker's report delivery and clean exit on a loaded machine.
EXIT_BOUND_S = 20.0


class Worker:
    """One ``steward worker`` subprocess; its output (stdout and stderr) in a log file."""

    def __init__(self, worker_port: int, url: str, worker_id: str, log: Path) -> None:
        self.log = log
        # Task users must reach the work dir: not under pytest's private tmp_path.
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"steward-stop-{worker_id}-"))
        self.work_dir.chmod(0o755)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    *steward_command(),
                    "worker",
                    "--broker",
                    f"{HOST}:{worker_port}",
                    "--http-url",
                    url,
                    "--worker-id",
                    worker_id,
                    "--task-type",
                    "*=2",
                    "--spark",
                    "off",
                    "--stop-grace-s",
                    str(GRACE_S),
                    "--cache-dir",
                    str(log.parent / f"{worker_id}-cache"),
                    "--work-dir",
                    str(self.work_dir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.work_dir, ignore_errors=True)


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def task(client: httpx.Client, task_id: int) -> dict[str, Any]:
    answer = client.get(f"/api/v1/tasks/{task_id}")
    answer.raise_for_status()
    body: dict[str, Any] = answer.json()
    return body


def submit_sleep(client: httpx.Client, seconds: float) -> int:
    answer = client.post("/api/v1/tasks", json={"type": "sleep", "params": {"seconds": seconds}})
    assert answer.status_code in (200, 201), answer.text
    task_id: int = answer.json()["id"]
    return task_id


def connected(client: httpx.Client, worker_id: str) -> bool:
    workers = client.get("/api/v1/cluster").json()["workers"]
    return any(w["id"] == worker_id and w["state"] == "connected" for w in workers)


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], None]]]:
    steps: list[Callable[[], None]] = []
    yield steps
    for step in reversed(steps):
        step()


def start_broker(tmp_path: Path, worker_port: int, *extra: str) -> BrokerProcess:
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{worker_port}", *extra),
    )
    broker.start()
    return broker


def test_worker_sigterm_lets_a_short_task_finish_and_gives_a_long_one_back(
    tmp_path: Path, cleanup: list[Callable[[], None]]
) -> None:
    worker_port = free_port()
    broker = start_broker(tmp_path, worker_port)
    cleanup.append(broker.kill9)
    first = Worker(worker_port, broker.url, "first", tmp_path / "first.log")
    cleanup.append(first.kill)
    with httpx.Client(base_url=broker.url, timeout=10) as client:
        wait_for(lambda: connected(client, "first"), 60, "the first worker connects")
        short = submit_sleep(client, 1)
        long = submit_sleep(client, GRACE_S + 25)  # outlasts the grace by far
        wait_for(
            lambda: all(task(client, t)["state"] == "running" for t in (short, long)),
            30,
            "both tasks run on the first worker",
        )
        stopped_at = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping" in first.output(), 10, "the worker says it is stopping")
        code = first.proc.wait(timeout=GRACE_S + EXIT_BOUND_S)
        took_s = time.monotonic() - stopped_at
        output = first.output()
        assert code == 0, output
        assert "Traceback" not in output, output
        line = next(x for x in output.splitlines() if "stopping:" in x)
        assert re.search(r"waiting for 2 running tasks .*grace 5 s", line), line
        assert "--stop-grace-s" in line
        assert re.search(r"gave 1 running task back .*not counted as failed", output), output
        assert took_s >= GRACE_S - 0.5, f"exited after {took_s:.1f} s, before the grace"

        done = task(client, short)
        assert (done["state"], done["attempt"]) == ("finished", 1), done
        given_back = task(client, long)
        # Waiting again, not failed: no worker is connected now.
        assert given_back["state"] == "waiting", given_back
        assert "given back" in (given_back["error"] or "") or "stopping" in (
            given_back["error"] or ""
        ), given_back

        second = Worker(worker_port, broker.url, "second", tmp_path / "second.log")
        cleanup.append(second.kill)
        # max_attempts is 1: a counted first attempt would have failed the task for good.
        wait_for(lambda: task(client, long)["state"] == "running", 60, "the second worker runs it")
        rerun = task(client, long)
        assert (rerun["worker"], rerun["attempt"], rerun["max_attempts"]) == ("second", 2, 1)


def test_standalone_broker_sigterm_waits_for_running_tasks_then_gives_the_rest_back(
    tmp_path: Path, cleanup: list[Callable[[], None]]
) -> None:
    worker_port = free_port()
    broker = start_broker(tmp_path, worker_port, "--stop-grace-s", "4")
    cleanup.append(broker.kill9)
    worker = Worker(worker_port, broker.url, "w1", tmp_path / "w1.log")
    cleanup.append(worker.kill)
    with httpx.Client(base_url=broker.url, timeout=10) as client:
        wait_for(lambda: connected(client, "w1"), 60, "the worker connects")
        short = submit_sleep(client, 1)
        long = submit_sleep(client, 60)
        wait_for(
            lambda: all(task(client, t)["state"] == "running" for t in (short, long)),
            30,
            "both tasks run",
        )
    stopped_at = time.monotonic()
    code = broker.terminate(timeout_s=4 + EXIT_BOUND_S)
    took_s = time.monotonic() - stopped_at
    output = broker.start_output()
    assert code == 0, output
    assert "Traceback" not in output, output
    line = next(x for x in output.splitlines() if "stopping: waiting" in x)
    assert re.search(r"waiting for 2 running tasks to finish \(grace 4 s, --stop-grace-s\)", line)
    assert re.search(r"gave 1 running task back to the queue.*not counted as failed", output)
    assert took_s >= 3.5, f"the broker stopped after {took_s:.1f} s, before its grace"

    # After a restart: the short task finished within the grace; the long one was given
    # back (not failed), and the worker, which reconnects by itself, runs it again.
    broker.start()
    with httpx.Client(base_url=broker.url, timeout=10) as client:
        done = task(client, short)
        assert (done["state"], done["attempt"]) == ("finished", 1), done
        wait_for(
            lambda: task(client, long)["attempt"] == 2 and task(client, long)["state"] == "running",
            60,
            "the given-back task runs again",
        )


def test_ctrl_c_on_a_standalone_broker_with_its_own_workers_keeps_their_grace(
    tmp_path: Path, cleanup: list[Callable[[], None]]
) -> None:
    # A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the
    # workers `--workers` started must get one signal (from the broker), not two.
    http_port = free_port()
    url = f"http://{HOST}:{http_port}"
    log = tmp_path / "standalone.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *steward_command(),
                "standalone",
                "--data-dir",
                str(tmp_path / "data"),
                "--http",
                f"{HOST}:{http_port}",
                "--worker-listen",
                f"{HOST}:{free_port()}",
                "--workers",
                "1",
                "--stop-grace-s",
                "5",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,  # its own process group, as a shell gives it
        )

    def kill() -> None:
        # Its workers run in sessions of their own: kill them by pid too.
        for pid in [proc.pid, *_children(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)

    cleanup.append(kill)
    with httpx.Client(base_url=url, timeout=10) as client:
        wait_for(lambda: _answers(client), 60, "the broker serves")
        wait_for(lambda: _any_worker(client), 60, "its worker connects")
        short = submit_sleep(client, 1)
        long = submit_sleep(client, 60)
        wait_for(
            lambda: all(task(client, t)["state"] == "running" for t in (short, long)),
            30,
            "both tasks run",
        )
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        code = proc.wait(timeout=5 + EXIT_BOUND_S)
    output = log.read_text(errors="replace")
    assert code == 0, output
    assert "Traceback" not in output, output
    assert "waiting for 2 running tasks" in output, output
    # Both the broker and its worker waited: the short task finished, the long one was
    # given back (by whichever of them came first), nothing failed.
    assert re.search(r"gave 1 running task back", output), output
    proc2 = BrokerProcess(tmp_path / "data", log_path=tmp_path / "restart.log")
    proc2.start()
    cleanup.append(proc2.kill9)
    with httpx.Client(base_url=proc2.url, timeout=10) as client:
        done, given_back = task(client, short), task(client, long)
    assert (done["state"], done["attempt"]) == ("finished", 1), done
    assert given_back["state"] == "waiting" and "given back" in given_back["error"], given_back


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def _any_worker(client: httpx.Client) -> bool:
    workers = client.get("/api/v1/cluster").json()["workers"]
    return any(w["state"] == "connected" for w in workers)


def test_a_standalone_broker_killed_9_takes_its_own_workers_with_it(tmp_path: Path) -> None:
    # Its workers run in sessions of their own (Ctrl-C above), so a process-group kill
    # misses them: they must stop when the broker dies, not retry it forever as orphans.
    with BrokerProcess(
        tmp_path / "data", log_path=tmp_path / "broker.log", extra_args=("--workers", "1")
    ) as broker:
        broker.start()
        assert broker.proc is not None
        with httpx.Client(base_url=broker.url, timeout=10) as client:
            wait_for(lambda: _any_worker(client), 60, "its worker connects")
        workers = _children(broker.proc.pid)
        assert workers, "the broker started no worker process"
        try:
            os.kill(broker.proc.pid, signal.SIGKILL)
            broker.proc.wait(timeout=10)
            wait_for(
                lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers),
                EXIT_BOUND_S,
                "its workers exit after the broker's kill -9",
            )
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
