"""Task progress pieces: ``ctx.progress`` (clients/worker/task_api.py), the worker link's
Progress frames (thread-run tasks, a fake broker) and the leader's ProgressStore
(broker/api/progress_store.py). End to end: tests/integration/test_task_progress.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker.api.progress_store import ProgressStore
from clients.worker import TaskContext
from tests.support.worker_harness import WAIT_S, Env, task, worker_env
from wire.worker_protocol import AssignedTask, Progress, TaskAttempt


def _ctx() -> TaskContext:
    return TaskContext(AssignedTask(task_id=7, attempt=2, type="t", tenant="a"))


def test_progress_keeps_the_latest_report_and_cuts_long_messages() -> None:
    ctx = _ctx()
    assert ctx.latest_progress() is None
    ctx.progress(0, "start")
    ctx.progress(1, "m" * 500)
    assert ctx.latest_progress() == (2, 1.0, "m" * 200)
    sent: list[tuple[float, str]] = []
    ctx._progress_sink = lambda fraction, message: sent.append((fraction, message))
    ctx.progress(0.5)
    assert sent == [(0.5, "")] and ctx.latest_progress() == (3, 0.5, "")


@pytest.mark.parametrize(
    ("fraction", "message", "error"),
    [
        (1.5, "", ValueError),
        (-0.1, "", ValueError),
        (float("nan"), "", ValueError),
        (True, "", ValueError),
        ("0.5", "", ValueError),
        (0.5, 3, TypeError),
    ],
)
def test_progress_refuses_bad_values(fraction: Any, message: Any, error: type[Exception]) -> None:
    ctx = _ctx()
    with pytest.raises(error, match="progress"):
        ctx.progress(fraction, message)
    assert ctx.latest_progress() is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_rate_limits_each_task_and_prefers_newer_attempts() -> None:
    clock = _Clock()
    store = ProgressStore(min_interval_s=0.25, clock=clock, wall_ms=lambda: 1_000)
    assert store.put(1, 1, 0.1, "a")
    assert not store.put(1, 1, 0.2, "b")  # too soon after the last one taken
    assert store.put(2, 1, 0.9, "other task")  # limited per task
    clock.now = 0.3
    assert store.put(1, 1, 0.3, "c")
    assert store.put(1, 2, 0.0, "retry")  # a newer attempt's first report: at once
    clock.now = 10.0
    assert not store.put(1, 1, 0.5, "late report of the old attempt")
    progress = store.get(1)
    assert progress is not None
    assert (progress.attempt, progress.fraction, progress.message) == (2, 0.0, "retry")
    assert progress.updated_ms == 1_000 and store.refused == 2
    store.forget(1)
    assert store.get(1) is None and store.get(3) is None


def test_store_is_bounded() -> None:
    store = ProgressStore(max_tasks=3, min_interval_s=0)
    for task_id in range(1, 6):
        store.put(task_id, 1, 0.5, "")
    store.put(3, 1, 0.6, "")  # reported again: kept longest
    assert len(store) == 3 and store.get(1) is None and store.get(2) is None
    assert store.get(3) is not None and store.get(5) is not None
    with pytest.raises(ValueError, match="positive"):
        ProgressStore(max_tasks=0)


# --- the worker link, thread-run tasks, a fake broker ------------------------------------


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with worker_env(tmp_path, stop_timeout_s=0.5, stop_wait_s=WAIT_S + 5) as environment:
        yield environment


async def test_the_link_sends_the_latest_progress_to_a_broker_that_takes_it(env: Env) -> None:
    worker = env.worker()
    conn = await env.broker.accept()
    conn.welcome(progress=True, output=True)
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)
    release = threading.Event()

    def steps(params: Any, ctx: TaskContext) -> str:
        for n in range(1000):
            ctx.progress(n / 1000, f"step {n}")
        ctx.progress(0.5, "half")
        release.wait(WAIT_S)
        return "done"

    worker.runtime.register("steps", steps)
    conn.assign(task(1, "steps"))
    frame = await conn.next(Progress)
    while frame.message != "half":  # a report sent before the last call may come first
        frame = await conn.next(Progress)
    assert (frame.task_id, frame.attempt, frame.fraction) == (1, 1, 0.5)
    await conn.expect_silence(1.5)  # unchanged since: nothing more is sent
    release.set()
    await conn.reports(1)


async def test_no_progress_frame_to_a_broker_that_does_not_take_them(env: Env) -> None:
    worker = env.worker()
    conn = await env.broker.accept()
    conn.welcome(output=True)  # an older broker: no progress flag
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)

    def steps(params: Any, ctx: TaskContext) -> None:
        ctx.progress(0.5, "half")
        ctx.check_cancelled()
        threading.Event().wait(1.5)  # long enough for the link's loop to run

    worker.runtime.register("steps", steps)
    conn.assign(task(1, "steps"))
    # Its first frame is the Finish (reports() asserts each frame's type): no Progress.
    await conn.reports(1)


async def test_a_new_connection_gets_the_latest_progress_again(env: Env) -> None:
    """A new leader holds no progress: the worker resends it on every new connection."""
    worker = env.worker()
    conn = await env.broker.accept()
    conn.welcome(progress=True)
    await asyncio.wait_for(worker.wait_connected(), WAIT_S)
    release = threading.Event()

    def steps(params: Any, ctx: TaskContext) -> str:
        ctx.progress(0.3, "before the failover")
        release.wait(WAIT_S)
        return "done"

    worker.runtime.register("steps", steps)
    conn.assign(task(1, "steps"))
    assert (await conn.next(Progress)).message == "before the failover"
    await conn.close()  # the leader is gone
    conn2 = await env.broker.accept()
    conn2.welcome(progress=True, keep=(TaskAttempt(1, 1),))
    again = await conn2.next(Progress)
    assert (again.task_id, again.attempt, again.fraction) == (1, 1, 0.3)
    assert again.message == "before the failover"
    release.set()
    await conn2.reports(1)
