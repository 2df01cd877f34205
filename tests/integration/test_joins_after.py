"""Joins and dependencies on real processes (issue 18, item 3): a standalone broker and a
worker process. ``after`` through the HTTP API (single and batch submit; a failed or
cancelled dependency fails the dependant; unknown and other tenants' ids refused), and a
join: the fan-out example's combiner, spawned by the root anchored to every partition,
runs once they all finished; an anchor of another tree is refused with a clear error."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import ConflictError, StewardClient
from examples.spark_fanout import fanout_job
from examples.spark_fanout.run import (
    direct_answer,
    share_out_dir,
    submit_fanout,
    upload_job,
    wait_fanout,
)
from tests.support.procs import BrokerProcess, fetch_all_tasks, steward_command
from tests.support.worker_procs import broker_with_worker, task_writable_dir

WAIT_S = 60.0
FOREIGN_JOB = '''
def foreign(params, ctx):
    """Anchors a child to a task of another tree: refused, this task fails."""
    ctx.spawn("foreign_job:leaf", anchors=[ctx.task_id, params["other"]])


def leaf(params, ctx):
    return "leaf"
'''


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("joins")
    with broker_with_worker(root, "joins-worker", ("--task-type", "*=8")) as (process, _):
        yield process


def _until(probe: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _task(http: httpx.Client, task_id: int) -> dict[str, Any]:
    response = http.get(f"/api/v1/tasks/{task_id}")
    assert response.status_code == 200, response.text
    task: dict[str, Any] = response.json()
    return task


def _final(http: httpx.Client, task_id: int) -> dict[str, Any]:
    final = ("finished", "error", "cancelled")
    return dict(_until(lambda: (t := _task(http, task_id))["state"] in final and t, "final"))


def test_a_task_runs_after_its_dependencies(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.url, timeout=30) as http:

        def submit(body: dict[str, Any]) -> int:
            response = http.post("/api/v1/tasks", json={"tenant": "dep", **body})
            assert response.status_code == 201, response.text
            return int(response.json()["id"])

        slow = submit({"type": "sleep", "params": {"seconds": 1.0}})
        quick = submit({"type": "sleep", "params": {"seconds": 0.1}})
        after = submit({"type": "sleep", "params": {"seconds": 0}, "after": [slow, quick]})
        shown = _task(http, after)
        assert shown["state"] == "waiting" and shown["after"] == [slow, quick]
        assert slow in shown["waiting_for"]  # the slow one still runs
        done = _final(http, after)
        assert done["state"] == "finished" and done["waiting_for"] == []
        assert done["finished_at"] >= _task(http, slow)["finished_at"]
        # A batch: each task waits for its own dependencies.
        response = http.post(
            "/api/v1/tasks",
            json={
                "tasks": [
                    {"type": "sleep", "tenant": "dep", "after": [after]},
                    {"type": "sleep", "tenant": "dep", "after": [10**12]},
                ]
            },
        )
        assert response.status_code == 200, response.text
        first, second = response.json()["tasks"]
        assert second["error"]["code"] == "not_found"
        assert _final(http, first["id"])["state"] == "finished"


def test_a_failed_or_cancelled_dependency_fails_the_dependant(broker: BrokerProcess) -> None:
    with StewardClient(broker.url) as client:
        # Starts in 1 s: still live when its dependant is submitted.
        later = time.time() + 1.0
        failing = client.submit("fail", {"message": "kaput"}, tenant="dep", start_after=later)
        on_failed = client.submit("sleep", {"seconds": 0}, tenant="dep", after=[failing.id])
        stuck = client.submit("sleep", {"seconds": 30}, tenant="dep")
        on_cancelled = client.submit("sleep", {"seconds": 0}, tenant="dep", after=[stuck.id])
        chained = client.submit("sleep", {"seconds": 0}, tenant="dep", after=[on_cancelled.id])
        stuck.cancel()
        records = client.wait_many([on_failed, on_cancelled, chained], timeout=WAIT_S)
        assert records[on_failed.id]["state"] == "error"
        assert records[on_failed.id]["error"] == f"dependency {failing.id} failed"
        assert records[on_cancelled.id]["error"] == f"dependency {stuck.id} was cancelled"
        assert records[chained.id]["error"] == f"dependency {on_cancelled.id} failed"
        # Once failed, it is refused as a dependency (409).
        with pytest.raises(ConflictError, match=f"task {failing.id} in after failed"):
            client.submit("sleep", {"seconds": 0}, tenant="dep", after=[failing.id])


def test_bad_dependencies_are_refused_with_a_clear_error(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.url, timeout=30) as http:
        mine = http.post("/api/v1/tasks", json={"type": "sleep", "tenant": "dep"}).json()["id"]
        cases = [
            ({"after": [10**12]}, 404, "does not exist"),
            ({"after": [mine], "tenant": "other"}, 404, "does not exist"),  # not its tenant's
            ({"after": [mine, mine]}, 400, "names a task twice"),
            ({"after": ["one"]}, 400, "after"),
            ({"after": list(range(1, 102))}, 400, "after"),
        ]
        for extra, status, words in cases:
            body = {"type": "sleep", "tenant": "dep", **extra}
            response = http.post("/api/v1/tasks", json=body)
            assert response.status_code == status, (extra, response.text)
            assert words in response.json()["error"]["message"], response.text


def test_the_fanout_joins_its_partitions_without_claim_files(broker: BrokerProcess) -> None:
    rows, partitions = 20_001, 4
    with task_writable_dir() as shared, StewardClient(broker.url) as client:
        out_dir = share_out_dir(shared / "out")
        handle = submit_fanout(
            client, upload_job(client), out_dir, rows=rows, partitions=partitions,
            engine="python", child_sleep_s=0.3,
        )  # fmt: skip
        outcome = wait_fanout(handle, timeout_s=WAIT_S)
        assert outcome.root["tree"]["state"] == "completed"
        assert outcome.answer == direct_answer(rows)
        # The partials and the answer only: no claim file picks the combiner any more.
        names = sorted(p.name for p in outcome.final_path.parent.iterdir())
        assert names == sorted(["final.json", *(f"part-{i:04d}.json" for i in range(partitions))])
    with httpx.Client(base_url=broker.url, timeout=30) as http:
        tasks = [t for t in fetch_all_tasks(http) if t.get("root") == handle.id]
    parts = [t for t in tasks if t["type"] == f"{fanout_job.MODULE}:partition"]
    (combine,) = [t for t in tasks if t["type"] == f"{fanout_job.MODULE}:combine"]
    assert combine["root"] == handle.id and combine["parent"] == handle.id
    assert combine["after"] == [t["id"] for t in parts] and combine["waiting_for"] == []
    # Every partition had finished before the join started (it ran once, after them).
    assert combine["attempt"] == 1
    assert all(t["finished_at"] <= combine["updated_at"] for t in parts)


def test_an_anchor_of_another_tree_is_refused(broker: BrokerProcess, tmp_path: Path) -> None:
    job = tmp_path / "foreign_job.py"
    job.write_text(FOREIGN_JOB, encoding="utf-8")
    with StewardClient(broker.url) as client:
        code = client.upload_code(job)
        other = client.submit("sleep", {"seconds": 0}, track_tree=True, tenant="dep")
        client.wait_many([other], timeout=WAIT_S)
        root = client.submit(
            "foreign_job:foreign", {"other": other.id}, code=code, track_tree=True, tenant="dep"
        )
        record = client.wait_many([root], timeout=WAIT_S)[root.id]
    assert record["state"] == "error"
    assert (
        f"anchor {other.id} is not a task of this task's tree (root {root.id})" in (record["error"])
    )
    assert record["tree"]["state"] == "failed"


def test_the_cli_submits_after(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.url, timeout=30) as http:
        first = http.post("/api/v1/tasks", json={"type": "sleep", "tenant": "dep"}).json()["id"]
        command = [*steward_command(), "--url", broker.url, "submit", "noop", "--tenant", "dep"]
        done = subprocess.run(
            [*command, "--after", str(first), "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        [submitted] = json.loads(done.stdout)
        task_id = int(submitted["id"])
        assert _final(http, task_id)["after"] == [first]
        refused = subprocess.run(
            [*command, "--after", str(10**12)], capture_output=True, text=True, timeout=30
        )
        assert refused.returncode != 0 and "does not exist" in refused.stderr
        assert "Traceback" not in refused.stderr
