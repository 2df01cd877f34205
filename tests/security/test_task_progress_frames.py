"""Issue 18 item 4 at the worker port: a Progress frame counts only from the connection its
running attempt was assigned to, with a fraction from 0 to 1 and a message of at most 200
characters; anything else is refused (logged) and never shown. The progress shows in
``GET /api/v1/tasks/{id}`` for the task's tenant only. A Node on in-memory ledgers with a
WorkerLink and the HTTP API in process, driven by a fake worker; every wait is bounded.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.secured_link import SecuredBroker, assigned_attempt, frames_broker
from wire import worker_protocol as p


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[SecuredBroker]:
    async with frames_broker(tmp_path, "progress") as harness:
        yield harness


async def test_progress_counts_only_from_the_attempts_connection_and_within_bounds(
    broker: SecuredBroker, caplog: pytest.LogCaptureFixture
) -> None:
    attempt = await assigned_attempt(broker)
    alice, bob, owner, other = attempt.alice, attempt.bob, attempt.owner, attempt.other
    assert attempt.welcome.progress  # this broker takes Progress frames
    task_id = attempt.task_id
    path = f"/api/v1/tasks/{task_id}"

    async def sent(worker: Any, **fields: Any) -> None:
        worker.send(p.Progress(task_id=task_id, **fields))
        worker.finish_ok(999, 1)  # a round trip: the Progress before it was handled
        await worker.expect(p.FinishAck)

    with caplog.at_level(logging.WARNING, logger="broker.workers.worker_link"):
        await sent(other, attempt=1, fraction=0.9, message="forged by w2")
        await sent(owner, attempt=2, fraction=0.9, message="not its attempt")
        for fraction in (float("nan"), 1.5, -0.5):
            await sent(owner, attempt=1, fraction=fraction, message="bad")
        await sent(owner, attempt=1, fraction=0.5, message="x" * (p.MAX_PROGRESS_CHARS + 1))
    refusals = [r.getMessage() for r in caplog.records if "refused progress" in r.getMessage()]
    assert len(refusals) == 6, refusals
    assert (await broker.get(alice, path)).json()["progress"] is None

    await sent(owner, attempt=1, fraction=0.5, message="half way")
    progress = (await broker.get(alice, path)).json()["progress"]
    assert progress["fraction"] == 0.5 and progress["message"] == "half way"
    assert progress["attempt"] == 1 and progress["updated_at"].endswith("Z")
    refused = await broker.get(bob, path)
    assert refused.status_code == 404 and "half way" not in refused.text

    owner.finish_ok(task_id, 1)
    await owner.expect(p.FinishAck)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="broker.workers.worker_link"):
        await sent(owner, attempt=1, fraction=1.0, message="after its end")
    assert any("a task not running" in r.getMessage() for r in caplog.records)
    # The last report taken stays readable after the task ended.
    assert (await broker.get(alice, path)).json()["progress"]["message"] == "half way"
