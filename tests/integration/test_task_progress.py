"""Issue 18 item 4, progress: ``ctx.progress(fraction, message)`` end to end.

A real ``steward standalone`` with authentication on and a real ``steward worker`` (task
processes under uids of their own). A running task reports progress; the report reaches
the leader over the worker link and shows in ``GET /api/v1/tasks/{id}`` (for the task's
tenant only) and ``steward task``, the latest report winning however often the task
calls (thousands of calls cost no log entry: the log position does not move while the
task reports). Every wait is bounded; processes are stopped when the test ends.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import steward_command
from tests.support.tenant_jobs import tenant_jobs
from tests.support.worker_procs import wait_until

pytestmark = pytest.mark.slow

ADMIN = "admin-secret-for-the-task-progress-test"
WORKER_TOKEN = "worker-token-for-the-task-progress-test-0123"

JOB = b"""\
import os, time


def _wait(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def steps(params, ctx):
    ctx.progress(0.25, "first quarter")
    _wait(params["step"])
    for n in range(5000):  # as often as a tight loop can: only the latest leaves
        ctx.progress(0.5 * n / 5000, "x" * 500)
    ctx.progress(0.75, "three quarters")
    _wait(params["release"])
    return "done"


def bad(params, ctx):
    ctx.progress(1.5, "too far")
"""


@dataclass
class Setup:
    url: str
    admin: httpx.Client
    alice: httpx.Client
    bob: httpx.Client
    alice_token: str
    sha: str
    shared: Path

    def submit(self, fn: str, params: dict[str, Any]) -> int:
        task = {"type": f"job:{fn}", "code": self.sha, "params": params}
        response = self.alice.post("/api/v1/tasks", json=task)
        assert response.status_code == 201, response.text
        task_id: int = response.json()["id"]
        return task_id

    def task(self, task_id: int) -> dict[str, Any]:
        response = self.alice.get(f"/api/v1/tasks/{task_id}")
        assert response.status_code == 200, response.text
        task: dict[str, Any] = response.json()
        return task

    def progress_is(self, task_id: int, fraction: float) -> dict[str, Any] | None:
        progress = self.task(task_id)["progress"]
        return progress if progress is not None and progress["fraction"] == fraction else None

    def position(self) -> Any:
        return self.admin.get("/healthz").json()["position"]


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    with tenant_jobs(
        tmp_path,
        admin_token=ADMIN,
        worker_token=WORKER_TOKEN,
        worker_id="w-progress",
        job=JOB,
        slots=4,
    ) as env:
        yield Setup(
            env.broker.url,
            env.admin,
            env.tenants["alice"],
            env.tenants["bob"],
            env.tokens["alice"],
            env.sha,
            env.shared,
        )


def test_a_running_tasks_progress_shows_in_the_api_and_the_cli(setup: Setup) -> None:
    step, release = setup.shared / "step", setup.shared / "release"
    task_id = setup.submit("steps", {"step": str(step), "release": str(release)})

    first = wait_until(lambda: setup.progress_is(task_id, 0.25), 60, "the first report")
    assert first["message"] == "first quarter" and first["attempt"] == 1
    assert first["updated_at"].endswith("Z")
    # Tenant-scoped like the task itself.
    assert setup.bob.get(f"/api/v1/tasks/{task_id}").status_code == 404

    position = setup.position()
    step.touch()
    latest = wait_until(lambda: setup.progress_is(task_id, 0.75), 60, "the latest report")
    assert latest["message"] == "three quarters"
    # Thousands of reports in between logged nothing (an idle leader's position stays).
    assert setup.position() == position

    shown = subprocess.run(
        [*steward_command(), "--url", setup.url, "task", str(task_id)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        env={**os.environ, "STEWARD_TOKEN": setup.alice_token, "PYTHONPATH": os.getcwd()},
    )
    assert shown.returncode == 0, shown.stderr.decode()
    assert "progress: 75% three quarters (attempt 1" in shown.stdout.decode()

    release.touch()
    done = setup.alice.get(f"/api/v1/tasks/{task_id}", params={"wait_s": 60}).json()
    assert done["state"] == "finished" and done["result"] == "done"


def test_a_bad_progress_report_fails_the_task_with_a_clear_error(setup: Setup) -> None:
    task_id = setup.submit("bad", {})
    done = setup.alice.get(f"/api/v1/tasks/{task_id}", params={"wait_s": 60}).json()
    assert done["state"] == "error", done
    assert "progress fraction must be a number from 0 to 1, not 1.5" in done["error"]
    assert done["progress"] is None
