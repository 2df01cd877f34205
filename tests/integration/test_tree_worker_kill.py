"""Issue 6 acceptance: a worker killed (``kill -9``) or stopped (``SIGSTOP``) in the middle
of a task tree. Real processes: a standalone broker and two workers. The tree fails
(a child ends in error, or the tree times out), the root is replayed (attempt 2 in the
API) and the replayed tree completes with the right answer.

The tree is the fan-out example's (examples/spark_fanout) with plain-Python partitions
that sleep first, so that the test can hit a worker while its children run.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import StewardClient, TaskHandle
from examples.spark_fanout import fanout_job
from examples.spark_fanout.run import (
    FanoutOutcome,
    direct_answer,
    submit_fanout,
    upload_job,
    wait_fanout,
)
from tests.support.procs import HOST, BrokerProcess, fetch_all_tasks, free_port
from tests.support.worker_procs import WorkerProcess, task_writable_dir, wait_until

pytestmark = pytest.mark.slow

ROWS, PARTITIONS = 40_000, 4
PART_TYPE = f"{fanout_job.MODULE}:partition"


class Setup:
    def __init__(self, root: Path, heartbeat_timeout_ms: int, shared: Path) -> None:
        self.root = root
        self.shared = shared  # written by the tasks, under their own uids
        self.worker_port = free_port()
        self.broker = BrokerProcess(
            root / "data",
            log_path=root / "logs" / "broker.log",
            extra_args=(
                "--worker-listen",
                f"{HOST}:{self.worker_port}",
                "--heartbeat-interval-ms",
                "250",
                "--heartbeat-timeout-ms",
                str(heartbeat_timeout_ms),
            ),
        )
        self.workers: list[WorkerProcess] = []
        self.http = httpx.Client(base_url="http://unset", timeout=30)

    def start(self) -> None:
        self.broker.start()
        self.http = httpx.Client(base_url=self.broker.url, timeout=30)
        for name in ("w1", "w2"):
            worker = WorkerProcess(
                broker=f"{HOST}:{self.worker_port}",
                http_url=self.broker.url,
                worker_id=name,
                log_dir=self.root / "logs",
                cache_dir=self.root / "cache" / name,
                # Room for every child on either worker; no Spark (plain-Python partitions).
                extra_args=("--task-type", "*=4"),
            ).start()
            self.workers.append(worker)
        for worker in self.workers:
            worker.wait_connected(self.http)

    def worker(self, worker_id: str) -> WorkerProcess:
        return next(w for w in self.workers if w.worker_id == worker_id)

    def task(self, task_id: int) -> dict[str, Any]:
        response = self.http.get(f"/api/v1/tasks/{task_id}")
        assert response.status_code == 200, response.text
        task: dict[str, Any] = response.json()
        return task

    def tree_tasks(self, root_id: int) -> list[dict[str, Any]]:
        return [t for t in fetch_all_tasks(self.http) if t.get("root") == root_id]

    def logs(self) -> str:
        return "\n".join(
            [self.broker.log_tail()] + [f"--- {w.worker_id}:\n{w.log_tail()}" for w in self.workers]
        )

    def close(self) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGCONT)  # a stopped worker cannot stop
            worker.stop()
        self.http.close()
        self.broker.kill9()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    with task_writable_dir() as path:
        yield path


@pytest.fixture
def make_setup(tmp_path: Path, shared_dir: Path) -> Iterator[Any]:
    made: list[Setup] = []

    def make(heartbeat_timeout_ms: int) -> Setup:
        shared = shared_dir / f"run{len(made)}"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        setup = Setup(tmp_path / f"run{len(made)}", heartbeat_timeout_ms, shared)
        made.append(setup)
        setup.start()
        return setup

    try:
        yield make
    finally:
        for setup in made:
            setup.close()


def _all_children_running(setup: Setup, root_id: int) -> list[dict[str, Any]] | None:
    """The first run's partitions once all of them run (each on a worker)."""
    parts = [t for t in setup.tree_tasks(root_id) if t["type"] == PART_TYPE]
    assert all(t["state"] in ("waiting", "running") for t in parts), parts
    if len(parts) == PARTITIONS and all(t["state"] == "running" for t in parts):
        return parts
    return None


def _check_replayed_tree(setup: Setup, outcome_root: dict[str, Any]) -> None:
    tree = outcome_root["tree"]
    assert tree["state"] == "completed", (tree, setup.logs())
    assert tree["attempt"] == 2
    assert outcome_root["state"] == "finished" and outcome_root["attempt"] == 2


def _start_tree(
    setup: Setup,
    client: StewardClient,
    out_dir: Path,
    *,
    tree_timeout_s: float,
    child_sleep_s: float,
    child_max_attempts: int,
    child_max_lost: int | None = None,
) -> tuple[TaskHandle, list[dict[str, Any]]]:
    """The fan-out tree (plain-Python partitions, root max_attempts 2) submitted, and its
    children once they all run."""
    handle = submit_fanout(
        client,
        upload_job(client),
        out_dir,
        rows=ROWS,
        partitions=PARTITIONS,
        engine="python",
        max_attempts=2,
        tree_timeout_s=tree_timeout_s,
        child_sleep_s=child_sleep_s,
        child_max_attempts=child_max_attempts,
        child_max_lost=child_max_lost,
    )
    first: list[dict[str, Any]] = wait_until(
        lambda: _all_children_running(setup, handle.id), 60, "the children to run"
    )
    return handle, first


def _first_run_dir(out_dir: Path, root_id: int) -> Path:
    return out_dir / f"root-{root_id}" / "attempt-1"


def _kill9_mid_tree(
    setup: Setup, out_dir: Path, *, child_max_attempts: int, child_max_lost: int | None = None
) -> tuple[TaskHandle, list[dict[str, Any]], str, FanoutOutcome]:
    """Start the tree (children sleep 3 s, the tree may take 120 s), kill -9 the worker
    running its first child, then wait for the tree to end. Returns the root's handle,
    the first run's children, the killed worker's id and the outcome."""
    with StewardClient(setup.broker.url) as client:
        handle, first = _start_tree(
            setup,
            client,
            out_dir,
            tree_timeout_s=120,
            child_sleep_s=3.0,
            child_max_attempts=child_max_attempts,
            child_max_lost=child_max_lost,
        )
        victim = first[0]["worker"]
        setup.worker(victim).kill9()
        outcome = wait_fanout(handle, timeout_s=90)
    return handle, first, victim, outcome


def test_kill9_of_a_worker_mid_tree_fails_the_tree_and_the_replay_is_correct(
    make_setup: Any,
) -> None:
    # A dead worker is declared within 1.5 s; the tree itself would wait 120 s.
    setup: Setup = make_setup(heartbeat_timeout_ms=1500)
    out_dir = setup.shared / "out"
    # Children that may lose no attempt with their worker (max_lost 0): the kill fails one
    # (docs/DESIGN.md §6, "Lost workers"; by default it would run again, the test below).
    handle, first, victim, outcome = _kill9_mid_tree(
        setup, out_dir, child_max_attempts=1, child_max_lost=0
    )

    _check_replayed_tree(setup, outcome.root)
    assert outcome.answer == direct_answer(ROWS)
    assert outcome.final_path.parent == out_dir / f"root-{handle.id}" / "attempt-2"
    # The first run: the killed worker's children ended in error naming it, the rest of
    # the run was cancelled (or had finished); it never produced an answer.
    by_id = {t["id"]: t for t in setup.tree_tasks(handle.id)}
    first_run = [by_id[t["id"]] for t in first]
    # The first of the killed worker's children to be declared lost fails the tree,
    # which cancels every other live task of the run (the killed worker's included).
    errors = [t for t in first_run if t["state"] == "error"]
    assert len(errors) == 1, first_run
    assert f"worker {victim} died" in errors[0]["error"], errors
    assert "(lost 1 times, max_lost 0)" in errors[0]["error"], errors
    assert errors[0]["id"] in {t["id"] for t in first if t["worker"] == victim}
    cancelled = [t for t in first_run if t["state"] == "cancelled"]
    assert all(f"tree of task {handle.id} failed" in t["error"] for t in cancelled), cancelled
    assert all(t["state"] in ("error", "cancelled", "finished") for t in first_run)
    assert not (_first_run_dir(out_dir, handle.id) / fanout_job.FINAL_FILE).exists()
    # The replay ran on the surviving worker only.
    survivor = "w2" if victim == "w1" else "w1"
    # The first run's join (the combiner, waiting for its partitions) was cancelled too.
    first_ids = {t["id"] for t in first}
    (first_join,) = [t for t in by_id.values() if set(t["after"]) == first_ids]
    assert first_join["state"] == "cancelled" and first_join["attempt"] == 0, first_join
    replayed = [t for t in by_id.values() if t["id"] not in first_ids | {first_join["id"]}]
    parts = [t for t in replayed if t["type"] == PART_TYPE]
    assert len(parts) == PARTITIONS and all(t["state"] == "finished" for t in replayed)
    assert {t["worker"] for t in parts} <= {survivor, None}, parts
    workers = {w["id"]: w for w in setup.http.get("/api/v1/cluster").json()["workers"]}
    assert workers[victim]["state"] == "dead"


def test_sigstop_of_a_worker_mid_tree_times_the_tree_out_and_the_replay_is_correct(
    make_setup: Any,
) -> None:
    # The stopped worker is not declared dead (30 s) before the tree times out (10 s).
    setup: Setup = make_setup(heartbeat_timeout_ms=30_000)
    out_dir = setup.shared / "out"
    with StewardClient(setup.broker.url) as client:
        handle, first = _start_tree(
            setup, client, out_dir, tree_timeout_s=10, child_sleep_s=2.0, child_max_attempts=1
        )
        victim = setup.worker(first[0]["worker"])
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: setup.task(handle.id)["tree"]["attempt"] == 2,
                60,
                "the tree to time out and its root to be replayed",
            )
        finally:
            # Resumed: it may hold the replayed root (it still counts as connected), and
            # its first-run children report late (their reports are stale and spawn nothing).
            os.kill(victim.proc.pid, signal.SIGCONT)
        outcome = wait_fanout(handle, timeout_s=90)

    _check_replayed_tree(setup, outcome.root)
    assert outcome.answer == direct_answer(ROWS)
    assert outcome.final_path.parent == out_dir / f"root-{handle.id}" / "attempt-2"
    by_id = {t["id"]: t for t in setup.tree_tasks(handle.id)}
    stopped = by_id[first[0]["id"]]
    assert stopped["state"] == "cancelled", stopped
    assert "tree timed out" in stopped["error"], stopped
    assert not (_first_run_dir(out_dir, handle.id) / fanout_job.FINAL_FILE).exists()
    workers = {w["id"]: w for w in setup.http.get("/api/v1/cluster").json()["workers"]}
    assert workers[victim.worker_id]["state"] == "connected"


def test_kill9_keeps_the_tree_on_its_first_run(make_setup: Any) -> None:
    # Children with max_attempts=1: their attempts lost with the killed worker do not count
    # (docs/DESIGN.md §6, "Lost workers"), so they run again (same task ids) on the other
    # worker, and the tree neither fails nor replays its root.
    setup: Setup = make_setup(heartbeat_timeout_ms=1500)
    out_dir = setup.shared / "out"
    handle, first, victim, outcome = _kill9_mid_tree(setup, out_dir, child_max_attempts=1)

    tree = outcome.root["tree"]
    assert tree["state"] == "completed" and tree["attempt"] == 1, (tree, setup.logs())
    assert outcome.root["attempt"] == 1
    assert outcome.answer == direct_answer(ROWS)
    assert outcome.final_path.parent == _first_run_dir(out_dir, handle.id)
    by_id = {t["id"]: t for t in setup.tree_tasks(handle.id)}
    assert all(t["state"] == "finished" for t in by_id.values()), by_id
    rerun = [by_id[t["id"]] for t in first if t["worker"] == victim]
    assert rerun and all((t["attempt"], t["lost"]) == (2, 1) for t in rerun), rerun
    assert all(by_id[t["id"]]["attempt"] == 1 for t in first if t["worker"] != victim)
