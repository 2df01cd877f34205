"""Queue time and run time told apart (issue 30, docs/API.md, "Task times"), on a real
standalone broker with a real worker: a task that waited for its worker to be free shows
``started_at`` and ``queued_ms`` (started_at - created_at for a first attempt) in ``GET
/api/v1/tasks/{id}`` and in ``steward task ID``. Every wait is bounded.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.support.procs import steward_output
from tests.support.worker_procs import broker_with_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _ms(stamp: str) -> int:
    return round(datetime.fromisoformat(stamp).timestamp() * 1000)


def test_a_queued_task_shows_when_it_started_and_how_long_it_waited(tmp_path: Path) -> None:
    # One slot: the second task waits in the queue while the first one runs.
    with broker_with_worker(tmp_path, "times-worker", ("--task-type", "*=1")) as (broker, _):
        with httpx.Client(base_url=broker.url, timeout=30) as http:
            body = {"tasks": [{"type": "sleep", "params": {"seconds": 0.5}}, {"type": "noop"}]}
            answer = http.post("/api/v1/tasks", json=body)
            assert answer.status_code == 200, answer.text
            first, second = (t["id"] for t in answer.json()["tasks"])
            views = []
            for task_id in (first, second):
                view = http.get(f"/api/v1/tasks/{task_id}", params={"wait_s": 30}).json()
                assert view["state"] == "finished", view
                views.append(view)
        for view in views:
            created, started = _ms(view["created_at"]), _ms(view["started_at"])
            assert view["queued_ms"] == started - created, view
            assert started <= _ms(view["finished_at"])
        # The second could start only once the first had finished.
        assert _ms(views[1]["started_at"]) >= _ms(views[0]["finished_at"])
        assert views[1]["queued_ms"] > views[0]["queued_ms"]

        shown = steward_output(broker.url, "task", str(second))
        lines = shown.splitlines()
        assert f"    queued_ms: {views[1]['queued_ms']}" in lines, shown
        assert f"   started_at: {views[1]['started_at']}" in lines, shown
