"""Issue 18 item 4 on real processes (a standalone broker and a worker process): task
priorities within a tenant, retry backoff whose due time survives a broker crash, and a
bulk cancel by filter from the CLI, and the per-tenant submit rate limit."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, free_port, steward_command
from tests.support.worker_procs import WorkerProcess, wait_until


class Setup:
    def __init__(self, broker: BrokerProcess, worker_port: int, root: Path) -> None:
        self.broker = broker
        self.worker_address = f"{HOST}:{worker_port}"
        self.root = root
        self.http = httpx.Client(base_url=broker.url, timeout=30)
        self.workers: list[WorkerProcess] = []

    def reconnect(self) -> None:
        """A new HTTP client: a restarted broker listens on a new HTTP port."""
        self.http.close()
        self.http = httpx.Client(base_url=self.broker.url, timeout=30)

    def worker(self, worker_id: str, *args: str) -> WorkerProcess:
        process = WorkerProcess(
            broker=self.worker_address,
            http_url=self.broker.url,
            worker_id=worker_id,
            log_dir=self.root / "logs",
            cache_dir=self.root / "cache" / worker_id,
            extra_args=args,
        ).start()
        self.workers.append(process)
        process.wait_connected(self.http)
        return process

    def task(self, task_id: int) -> dict[str, Any]:
        response = self.http.get(f"/api/v1/tasks/{task_id}")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def wait_state(self, task_id: int, states: set[str], timeout_s: float) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            task = self.task(task_id)
            return task if task["state"] in states else None

        found: dict[str, Any] = wait_until(reached, timeout_s, f"task {task_id} to reach {states}")
        return found


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    worker_port = free_port()
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "logs" / "broker.log",
        extra_args=("--worker-listen", f"{HOST}:{worker_port}", "--heartbeat-interval-ms", "250"),
    )
    broker.start()
    setup = Setup(broker, worker_port, tmp_path)
    try:
        yield setup
    finally:
        for worker in setup.workers:
            worker.stop()
        setup.http.close()
        broker.kill9()


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_higher_priority_tasks_of_a_tenant_run_first(setup: Setup) -> None:
    setup.worker("prio-w", "--tenant", "prio", "--task-type", "*=1")
    blocker = setup.http.post(
        "/api/v1/tasks", json={"type": "sleep", "tenant": "prio", "params": {"seconds": 1.0}}
    ).json()["id"]
    setup.wait_state(blocker, {"running"}, 30)
    priorities = [0, 0, 5, 5, 1, -1]
    batch = [
        {"type": "sleep", "tenant": "prio", "params": {"seconds": 0.05}, "priority": p}
        for p in priorities
    ]
    response = setup.http.post("/api/v1/tasks", json={"tasks": batch})
    assert response.status_code == 200, response.text
    ids = [item["id"] for item in response.json()["tasks"]]
    done = [setup.wait_state(i, {"finished", "error"}, 60) for i in ids]
    assert {t["state"] for t in done} == {"finished"}, done
    assert [t["priority"] for t in done] == priorities
    # One slot: tasks run one at a time, so finish order is start order.
    order = [t["id"] for t in sorted(done, key=lambda t: t["finished_at"])]
    assert order == [ids[2], ids[3], ids[4], ids[0], ids[1], ids[5]]


def test_retry_backoff_delays_retries_and_its_due_time_survives_a_crash(setup: Setup) -> None:
    setup.worker("backoff-w", "--tenant", "backoff", "--task-type", "*=2")
    body = {
        "type": "fail",
        "tenant": "backoff",
        "params": {"message": "flaky"},
        "max_attempts": 3,
        "retry_backoff_s": 2.0,
        "retry_backoff_max_s": 3.0,
    }
    response = setup.http.post("/api/v1/tasks", json=body)
    assert response.status_code == 201, response.text
    task_id = response.json()["id"]
    delayed = setup.wait_state(task_id, {"delayed"}, 30)
    assert delayed["attempt"] == 1 and delayed["retry_backoff_s"] == 2.0
    due = delayed["start_after"]
    wait_s = _seconds(due) - _seconds(delayed["updated_at"])
    assert 1.5 <= wait_s <= 2.5, delayed  # retry 1: 2 s, +-25%
    # A crash while the retry waits: the due time is in the log, not in memory.
    setup.broker.kill9()
    setup.broker.start()
    setup.reconnect()
    after = setup.task(task_id)
    if after["state"] == "delayed":
        assert after["start_after"] == due

    def second_failure() -> dict[str, Any] | None:
        task = setup.task(task_id)
        return task if task["attempt"] >= 2 and task["state"] in ("delayed", "error") else None

    second = wait_until(second_failure, 60, f"task {task_id} to fail its second attempt")
    assert second["state"] == "delayed" and second["attempt"] == 2, second
    wait_s = _seconds(second["start_after"]) - _seconds(second["updated_at"])
    assert 2.25 <= wait_s <= 3.75, second  # retry 2: 4 s capped at 3, +-25%
    final = setup.wait_state(task_id, {"error"}, 60)
    assert final["attempt"] == 3 and "flaky" in final["error"], final
    assert _seconds(final["updated_at"]) >= _seconds(second["start_after"])


def _steward(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "STEWARD_URL"}
    return subprocess.run(
        [*steward_command(), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_bulk_cancel_by_filter_from_the_cli(setup: Setup) -> None:
    setup.worker("bulk-w", "--tenant", "bulk", "--task-type", "*=1")
    sleeper = {"type": "sleep", "tenant": "bulk", "params": {"seconds": 30}}
    running = setup.http.post("/api/v1/tasks", json=sleeper).json()["id"]
    setup.wait_state(running, {"running"}, 30)
    # No worker serves "keep": its task waits (allow_unknown_type), never refused or run.
    keep = {"type": "noop", "tenant": "keep", "allow_unknown_type": True}
    batch = [{"type": "noop", "tenant": "bulk"}] * 1500 + [keep]
    submitted = setup.http.post("/api/v1/tasks", json={"tasks": batch})
    assert submitted.status_code == 200, submitted.text
    ids = [item["id"] for item in submitted.json()["tasks"]]
    done = _steward(setup.broker.url, "cancel", "--tenant", "bulk", "--state", "waiting", "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    answer = json.loads(done.stdout)
    assert answer == {"matched": 1500, "cancelled": 1500, "skipped": 0, "batches": 2}
    assert setup.task(ids[0])["state"] == "cancelled"
    assert setup.task(ids[-1])["state"] == "waiting"  # another tenant's
    assert setup.task(running)["state"] == "running"  # another state
    # The running one too, by type; its worker is told to stop it.
    done = _steward(setup.broker.url, "cancel", "--tenant", "bulk", "--type", "sleep")
    assert done.returncode == 0 and "1 cancelled of 1 matching" in done.stdout, done
    assert setup.wait_state(running, {"cancelled"}, 10)["error"] == "cancelled by request"
    # Neither an id nor a filter: a usage error, no traceback.
    refused = _steward(setup.broker.url, "cancel")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "filters" in refused.stderr


def test_submit_rate_limit_answers_429_with_retry_after(setup: Setup) -> None:
    limits = _steward(
        setup.broker.url, "tenant", "rated", "--submit-rate", "1", "--submit-burst", "2"
    )
    assert limits.returncode == 0 and "1/s" in limits.stdout, limits
    task = {"type": "noop", "tenant": "rated"}
    for _ in range(2):
        assert setup.http.post("/api/v1/tasks", json=task).status_code == 201
    refused = setup.http.post("/api/v1/tasks", json=task)
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert body["error"]["code"] == "rate_limited"
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 2
    time.sleep(retry_after)  # the bucket refills at 1 task/s
    assert setup.http.post("/api/v1/tasks", json=task).status_code == 201
    # Another tenant is not limited.
    other = setup.http.post("/api/v1/tasks", json={"type": "noop", "tenant": "unrated"})
    assert other.status_code == 201
