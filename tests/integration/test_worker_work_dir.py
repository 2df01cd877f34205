"""A worker's work dir (clients/worker/__main__.py, task_env.py): its default one is removed
when it stops cleanly, a given one is kept, and one worker at a time may use either
(real ``steward worker`` processes; no broker needed: they wait for one)."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.worker.config import default_work_dir
from clients.worker.task_env import WORK_DIR_LOCK
from tests.support.procs import HOST, free_port
from tests.support.worker_procs import WorkerProcess, task_writable_dir, wait_until

WAIT_S = 30.0


@pytest.fixture
def no_broker() -> str:
    return f"{HOST}:{free_port()}"  # nothing listens: the workers keep waiting


def worker(tmp_path: Path, broker: str, worker_id: str, *args: str) -> WorkerProcess:
    return WorkerProcess(
        broker=broker,
        http_url=f"http://{broker}",
        worker_id=worker_id,
        log_dir=tmp_path / secrets.token_hex(4),  # one log per process, same id or not
        cache_dir=tmp_path / "cache",
        extra_args=("--task-type", "noop=1", *args),
    )


def wait_running(proc: WorkerProcess) -> None:
    """Until its link waits for the broker: past its start, its signal handlers set."""

    def running() -> bool:
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
        return "waiting for the worker endpoint" in proc.log_tail()

    wait_until(running, WAIT_S, f"{proc.name} to run")


def refused(proc: WorkerProcess) -> str:
    """The output of a worker expected to exit 2 at once."""
    code = proc.wait_for_exit(WAIT_S, why=": a second worker on a work dir in use")
    assert code == 2, proc.log_tail()
    return proc.log_tail()


def sigterm(proc: WorkerProcess) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait_for_exit(WAIT_S, why=" after SIGTERM") == 0, proc.log_tail()


@pytest.fixture
def procs() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.stop()


def test_a_worker_stopped_with_sigterm_leaves_no_default_work_dir(
    tmp_path: Path, no_broker: str, procs: list[WorkerProcess]
) -> None:
    worker_id = f"wd-{secrets.token_hex(4)}"
    work = default_work_dir(worker_id)
    first = worker(tmp_path, no_broker, worker_id)  # task processes: homes made at start
    procs.append(first.start())
    wait_running(first)
    assert (work / WORK_DIR_LOCK).is_file() and (work / "homes").is_dir()
    second = worker(tmp_path, no_broker, worker_id)  # same id: same default dir
    procs.append(second.start())
    out = refused(second)
    assert f"work dir {work} is in use by another worker (pid {first.pid})" in out, out
    assert "--work-dir" in out and "Traceback" not in out, out
    assert (work / "homes").is_dir()  # the refused one removed nothing of the first's
    sigterm(first)
    assert not work.exists()


def test_a_given_work_dir_is_kept_and_used_by_one_worker_at_a_time(
    tmp_path: Path, no_broker: str, procs: list[WorkerProcess]
) -> None:
    with task_writable_dir("steward-test-work-") as shared:
        work = shared / "work"
        given = ("--work-dir", str(work), "--task-isolation", "thread")
        first = worker(tmp_path, no_broker, "wd-given-1", *given)
        procs.append(first.start())
        wait_running(first)
        second = worker(tmp_path, no_broker, "wd-given-2", *given)
        procs.append(second.start())
        out = refused(second)
        assert f"work dir {work} is in use by another worker" in out and "--work-dir" in out
        sigterm(first)
        assert (work / WORK_DIR_LOCK).is_file()  # never removed: the user named it
        third = worker(tmp_path, no_broker, "wd-given-3", *given)  # free again
        procs.append(third.start())
        wait_running(third)
        sigterm(third)


def test_a_worker_of_a_standalone_broker_waits_for_its_previous_self(
    tmp_path: Path, no_broker: str, procs: list[WorkerProcess]
) -> None:
    """A standalone broker restarted after kill -9 starts its worker again (same id, same
    work dir) while the previous one may still be giving its tasks back: the new one
    waits for the lock instead of exiting."""
    with task_writable_dir("steward-test-work-") as shared:
        given = ("--work-dir", str(shared / "work"), "--task-isolation", "thread")
        previous = worker(tmp_path, no_broker, "wd-standalone-1", *given)
        procs.append(previous.start())
        wait_running(previous)
        # This process stands in for the broker: the worker's parent.
        restarted = worker(tmp_path, no_broker, "wd-standalone-1", *given)
        restarted.env = {"STEWARD_WORKER_PARENT_PID": str(os.getpid())}
        procs.append(restarted.start())
        wait_until(
            lambda: "waiting up to 25 s for it to stop" in restarted.log_tail(),
            WAIT_S,
            "the restarted worker to wait",
        )
        assert restarted.running()
        sigterm(previous)
        wait_running(restarted)
        sigterm(restarted)


def test_a_standalone_broker_s_worker_has_a_default_work_dir_of_its_own(
    tmp_path: Path, no_broker: str, procs: list[WorkerProcess]
) -> None:
    """Every standalone broker names its workers <broker id>-worker-N, so the broker's pid
    is in their default work dir: two standalone brokers on one host (the demo beside
    another broker) both get their workers. Here: one started by a (stand-in) broker, one
    of the same id started by hand, each in a dir of its own."""
    worker_id = f"wd-{secrets.token_hex(4)}"
    by_broker = worker(tmp_path, no_broker, worker_id)
    by_broker.env = {"STEWARD_WORKER_PARENT_PID": str(os.getpid())}  # this process: its parent
    by_hand = worker(tmp_path, no_broker, worker_id)
    started = [
        (by_broker, default_work_dir(f"{worker_id}-{os.getpid()}")),
        (by_hand, default_work_dir(worker_id)),
    ]
    for proc, _ in started:
        procs.append(proc.start())
    for proc, work in started:
        wait_running(proc)
        wait_until(lambda work=work: (work / WORK_DIR_LOCK).is_file(), WAIT_S, f"{work}")
    for proc, work in started:
        sigterm(proc)
        assert not work.exists()
