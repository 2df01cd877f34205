"""Issue 30 item 6: a killed worker shows ``disconnected`` at once, not ``connected`` until
the heartbeat timeout (docs/DESIGN.md §8, "Closed connections"). Real processes: a
standalone broker and a ``steward worker`` process, read through the HTTP API the dashboard
reads.

A task runs the built-in ``sleep`` on w1 under a heartbeat timeout of 12 s; w1 is killed
with -9. Within half the timeout the worker view says ``disconnected`` and the task, still
``running``, says its worker is disconnected and since when (the dashboard's ``lost?``);
once the timeout has passed the worker is dead and the task waits again, lost as before
(tests/integration/test_lost_worker.py). Without the change the worker stays ``connected``
until it is declared dead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, BrokerProcess, free_port
from tests.support.worker_procs import WorkerProcess, wait_until

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 12.0


def test_a_killed_worker_shows_disconnected_at_once_and_its_task_lost_suspected(
    tmp_path: Path,
) -> None:
    worker_port = free_port()
    broker = BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        extra_args=(
            "--worker-listen",
            f"{HOST}:{worker_port}",
            "--heartbeat-interval-ms",
            "500",
            "--heartbeat-timeout-ms",
            str(int(HEARTBEAT_TIMEOUT_S * 1000)),
        ),
    )
    w1 = WorkerProcess(
        broker=f"{HOST}:{worker_port}",
        http_url=broker.url,
        worker_id="w1",
        log_dir=tmp_path / "logs",
        cache_dir=tmp_path / "cache",
    )
    broker.start()
    try:
        with httpx.Client(base_url=broker.url, timeout=30) as http:

            def worker() -> dict[str, Any]:
                workers = http.get("/api/v1/workers").json()["workers"]
                (found,) = [w for w in workers if w["id"] == "w1"]
                return found

            def task(task_id: int) -> dict[str, Any]:
                response = http.get(f"/api/v1/tasks/{task_id}")
                assert response.status_code == 200, response.text
                found: dict[str, Any] = response.json()
                return found

            w1.start().wait_connected(http)
            submitted = http.post(
                "/api/v1/tasks",
                json={"type": "sleep", "params": {"seconds": 60}, "max_attempts": 1},
            )
            assert submitted.status_code in (200, 201), submitted.text
            task_id = submitted.json()["id"]
            running = wait_until(
                lambda: (t := task(task_id))["state"] == "running" and t, 30, "the task to run"
            )
            assert (running["worker"], running["worker_state"]) == ("w1", "connected"), running
            assert running["lost_suspected_at"] is None

            w1.kill9()
            # Well within the timeout: only the closed connection can have told it.
            gone = wait_until(
                lambda: (w := worker())["state"] != "connected" and w,
                HEARTBEAT_TIMEOUT_S / 2,
                "w1 to show disconnected",
            )
            assert gone["state"] == "disconnected", (gone, broker.log_tail())
            assert gone["running"] == [task_id], gone
            suspected = task(task_id)
            assert suspected["state"] == "running", suspected  # not lost until the timeout
            assert suspected["worker_state"] == "disconnected", suspected
            assert suspected["lost_suspected_at"] == gone["updated_at"], (suspected, gone)
            assert (suspected["lost"], suspected["attempt"]) == (0, 1), suspected
            listed = http.get("/api/v1/tasks", params={"state": "running"}).json()["tasks"]
            assert [t["worker_state"] for t in listed] == ["disconnected"], listed
            metrics = http.get("/metrics").text
            assert "steward_workers_disconnected 1.0" in metrics

            # The heartbeat timeout still decides: then dead, its attempt lost, not counted.
            lost = wait_until(
                lambda: (t := task(task_id))["lost"] == 1 and t,
                3 * HEARTBEAT_TIMEOUT_S,
                "w1 to be declared dead and its attempt lost",
            )
            assert lost["state"] == "waiting", (lost, broker.log_tail())
            assert (lost["worker_state"], lost["lost_suspected_at"]) == (None, None), lost
            assert "worker w1 died: no heartbeat" in lost["error"], lost
            assert worker()["state"] == "dead"
    finally:
        w1.stop()
        broker.kill9()
