"""When an attempt started and how long it was queued (issue 30, docs/API.md, "Task times"):
``started_ms`` / ``queued_ms`` on the task record, set by apply from the entry's time (format
5 on), shown as ``started_at`` / ``queued_ms`` in task views and by ``steward task ID``."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core import StateMachine
from broker.core import entries as e
from broker.core.backoff import retry_delay_ms
from broker.core.snapshot_body import body_version
from clients.cli import output
from tests.support.http_api import Api, get_task, run_and_finish, submit
from tests.support.machine import Trees


def _cluster() -> Trees:
    m = Trees()
    m.apply(e.RegisterWorker(time_ms=m.now, worker_id="w1", task_types={"*": 4}))
    return m


def test_a_start_records_when_and_how_long_the_task_was_queued() -> None:
    m = _cluster()
    task_id = m.add()
    submitted = m.now
    assert m.m.tasks[task_id].started_ms is None
    m.at(1_500)
    m.assign(task_id)
    task = m.m.tasks[task_id]
    assert (task.started_ms, task.queued_ms) == (submitted + 1_500, 1_500)
    m.at(4_000)
    m.finish(m.outcome(task_id))
    # The last attempt's, once it is over: its run time is finished - started.
    assert (task.started_ms, task.queued_ms) == (submitted + 1_500, 1_500)
    assert task.finished_ms == submitted + 5_500


def test_a_retry_is_queued_from_its_due_time() -> None:
    m = _cluster()
    task_id = m.add(max_attempts=2, retry_backoff_ms=2_000)
    m.assign(task_id)
    failed_at = m.at(1_000)
    m.fail(task_id)
    due = failed_at + retry_delay_ms(task_id, 1, 2_000, e.DEFAULT_RETRY_BACKOFF_MAX_MS)
    m.tick(due - m.now)  # start_after reached: waiting again
    assert m.state(task_id) == "waiting"
    m.at(300)
    m.assign(task_id)
    task = m.m.tasks[task_id]
    assert (task.attempt, task.started_ms, task.queued_ms) == (2, due + 300, 300)


def test_an_immediate_retry_is_queued_from_the_failure() -> None:
    m = _cluster()
    task_id = m.add(max_attempts=2)
    m.assign(task_id)
    m.at(1_000)
    m.fail(task_id)
    m.at(250)
    m.assign(task_id)
    assert m.m.tasks[task_id].queued_ms == 250


def test_an_older_entry_starts_an_attempt_without_recording_it() -> None:
    """Replaying a log of older entries gives the state their snapshots held (no start),
    so that a broker replaying them and one loading such a snapshot agree."""
    m = _cluster()
    task_id = m.add()
    m.at(10)
    m.assign(task_id, v=e.STARTS_RECORDED_VERSION - 1)
    task = m.m.tasks[task_id]
    assert task.state == "running" and task.started_ms is None and task.queued_ms is None
    assert body_version(m.m.snapshot_body()) < 4


def test_a_recorded_start_survives_a_snapshot_and_needs_body_version_4() -> None:
    m = _cluster()
    task_id = m.add()
    m.at(42)
    m.assign(task_id)
    assert body_version(m.m.snapshot_body()) == 4
    copy = StateMachine.from_snapshot(m.m.encode_snapshot())
    assert copy.tasks[task_id].queued_ms == 42
    assert copy.digest() == m.m.digest()


def test_the_leader_writes_starting_entries_in_format_5() -> None:
    placed = (e.Assignment(1, "w1"),)
    spec = e.TaskSpec(id=1, type="noop", tenant="t")
    assert e.submit_version((spec,), placed) == e.STARTS_RECORDED_VERSION
    assert e.submit_version((spec,)) == e.BASE_ENTRY_FORMAT_VERSION


async def test_task_views_show_started_at_and_queued_ms(api: Api) -> None:
    task_id = (await submit(api))["id"]
    waiting = await get_task(api, task_id)
    assert waiting["started_at"] is None and waiting["queued_ms"] is None
    await run_and_finish(api.node, task_id)
    view = await get_task(api, task_id)
    task = api.node.state.tasks[task_id]
    assert task.started_ms is not None and task.queued_ms is not None
    assert view["started_at"].endswith("Z")
    assert view["queued_ms"] == task.queued_ms >= 0
    assert view["created_at"] <= view["started_at"] <= view["finished_at"]
    listed = (await api.get("/api/v1/tasks")).json()["tasks"]
    assert [(t["started_at"], t["queued_ms"]) for t in listed] == [
        (view["started_at"], view["queued_ms"])
    ]


@pytest.mark.parametrize("started", [True, False])
def test_steward_task_prints_queue_and_start(
    capsys: pytest.CaptureFixture[str], started: bool
) -> None:
    task: dict[str, Any] = {
        "id": 7,
        "type": "noop",
        "tenant": "acme",
        "state": "finished" if started else "waiting",
        "created_at": "2026-01-01T00:00:00.000Z",
        "queued_ms": 1234 if started else None,
        "started_at": "2026-01-01T00:00:01.234Z" if started else None,
    }
    output._print_task(task)
    lines = capsys.readouterr().out.splitlines()
    if started:
        assert "    queued_ms: 1234" in lines
        assert "   started_at: 2026-01-01T00:00:01.234Z" in lines
    else:
        assert not [line for line in lines if "queued_ms" in line or "started_at" in line]
