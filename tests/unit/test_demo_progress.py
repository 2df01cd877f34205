"""Issue 30, item 7: while the demo's worker starts Spark, the demo says so and shows the
time waited, never a guessed duration (a JVM starts in seconds idle, a minute loaded)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from clients.client import TaskHandle
from clients.demo import run as demo
from clients.progress import PIPE_INTERVAL_S

SPARK_START_S = 40.0  # how long the fake worker "starts Spark" before a task ends


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeClient:
    """The calls run_wordcount makes; every task read moves the clock 1 s on, and no task
    ends before SPARK_START_S."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.started = clock.now
        self.next_id = 0

    def upload_code(self, path: object) -> str:
        return "0" * 64

    def set_tenant(self, name: str, **limits: Any) -> dict[str, Any]:
        return {}

    def submit_many(self, batch: list[dict[str, Any]]) -> list[TaskHandle]:
        handles = []
        for _ in batch:
            self.next_id += 1
            handles.append(TaskHandle(self, self.next_id, "waiting"))  # type: ignore[arg-type]
        return handles

    def task(self, task_id: int, wait_s: float = 0.0) -> dict[str, Any]:
        self.clock.now += 1.0
        if self.clock.now - self.started < SPARK_START_S:
            return {"id": task_id, "state": "running"}
        return {"id": task_id, "state": "finished", "result": {"counts": {"w": 1}}}


def test_the_demo_shows_the_time_waited_for_spark_not_a_guess(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(demo.time, "monotonic", clock)
    said: list[str] = []
    outcome = demo.run_wordcount(
        FakeClient(clock),  # type: ignore[arg-type]
        ["a line"] * (demo.LINES_PER_TASK * 2),
        say=said.append,
    )
    assert outcome["tasks"] == 4
    first = said[0]
    assert "starting Spark" in first, said
    assert not re.search(r"\d+ ?s\b", first), f"a guessed duration: {first!r}"
    waited = [int(m.group(1)) for line in said if (m := re.search(r"Spark .* (\d+) s$", line))]
    # The time waited shows every PIPE_INTERVAL_S until the first task ends.
    assert len(waited) >= SPARK_START_S // PIPE_INTERVAL_S - 1, said
    assert waited == sorted(waited) and waited[-1] >= SPARK_START_S - PIPE_INTERVAL_S, said
