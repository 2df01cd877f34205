"""Pausing a schedule on a real standalone broker (docs/API.md, "Periodic tasks"): a 1 s
interval schedule paused with ``steward schedule pause`` creates no task while ticks pass,
and ``steward schedule resume`` makes it fire again, its missed ticks handled by its
``missed`` policy (skip: the latest runs, the others are counted skipped; no burst).

No worker runs: a tick's run is the task it creates. Every wait is bounded.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import BrokerProcess, steward_output
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

TENANT = "pausing"


def _view(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/api/v1/schedules/beat", params={"tenant": TENANT}, timeout=10)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _tasks(url: str) -> int:
    params = {"tenant": TENANT, "limit": 1000}
    listed = httpx.get(f"{url}/api/v1/tasks", params=params, timeout=10).json()
    return len(listed["tasks"])


def test_a_paused_schedule_creates_no_task_until_resumed(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data", log_path=tmp_path / "broker.log") as broker:
        broker.start()
        url = broker.url
        create = ("schedule", "create", "beat", "--tenant", TENANT, "--type", "noop")
        out = steward_output(url, *create, "--interval-s", "1")
        assert out.startswith(f"schedule beat of {TENANT}: next "), out
        wait_until(lambda: _view(url)["runs"] >= 1, 10, "the first tick's task")

        out = steward_output(url, "schedule", "pause", "beat", "--tenant", TENANT)
        assert out.startswith(f"schedule beat of {TENANT}: paused since "), out
        paused = _view(url)
        assert paused["paused"] is True, paused
        created = _tasks(url)
        assert created == paused["runs"]
        # Three ticks' time passes (the answer to pause came after the pause was applied):
        # nothing is created meanwhile.
        deadline = time.monotonic() + 3.2
        while time.monotonic() < deadline:
            assert _tasks(url) == created
            time.sleep(0.2)
        view = _view(url)
        assert (view["runs"], view["next_tick"]) == (paused["runs"], paused["next_tick"]), view
        listed = steward_output(url, "schedule", "list", "--tenant", TENANT)
        header, row = listed.splitlines()
        assert header.rstrip().endswith("PAUSED") and row.rstrip().endswith("yes"), listed

        out = steward_output(url, "schedule", "resume", "beat", "--tenant", TENANT)
        assert out == f"schedule beat of {TENANT}: running\n", out
        wait_until(lambda: _view(url)["runs"] >= paused["runs"] + 2, 10, "ticks after resume")
        view = _view(url)
        assert view["paused"] is False and view["paused_at"] is None, view
        # skip: of the ticks missed while paused only the latest ran, at most; the others
        # were counted skipped (a resume is no burst).
        assert view["skipped"] >= 2, view
        assert _tasks(url) == view["runs"]
        first = _ms(paused["next_tick"])
        before = paused["runs"] + paused["skipped"]
        handled = before + (_ms(view["next_tick"]) - first) // 1_000
        assert view["runs"] + view["skipped"] == handled, view


def _ms(iso: str) -> int:
    return round(datetime.fromisoformat(iso).timestamp() * 1000)
