"""Issue 16: a task submitted one call at a time, with a worker slot free, costs two log
entries (its submit, carrying its assignment, and its finish), not three
(docs/DESIGN.md §6). A real standalone broker and a real worker process; the broker's
``/metrics`` counts the entries applied.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from clients.client import StewardClient
from tests.support.worker_procs import broker_with_worker

TASKS = 20


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        found = re.match(rf"{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", line)
        if found:
            total += float(found.group(1))
    return total


def test_per_call_tasks_cost_two_entries_each(tmp_path: Path) -> None:
    with (
        broker_with_worker(tmp_path, "placed-worker", ("--task-type", "*=4")) as (broker, _),
        httpx.Client(base_url=broker.url, timeout=30) as http,
        StewardClient(broker.url) as client,
    ):
        before = metric(http, "steward_entries_applied_total")
        assigned_before = metric(http, "steward_tasks_assigned_total")
        for n in range(TASKS):
            handle = client.submit("noop", {"n": n}, tenant="placed")
            assert handle.result(timeout=30) is None
        entries = metric(http, "steward_entries_applied_total") - before
        assert metric(http, "steward_tasks_assigned_total") - assigned_before == TASKS
        # Submit (with its assignment) and finish: two per task, no AssignTasks entry.
        assert entries == 2 * TASKS, entries
