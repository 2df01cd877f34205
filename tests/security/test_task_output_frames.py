"""Issue 14, item 4 at the worker port: task output goes only where it belongs.

A worker's Output frames are kept only for an attempt assigned to that very connection (a
worker must not write into another tenant's task output); an oversized frame is a
protocol error; the leader that lacks an attempt's output asks the worker that ran it;
and the logs route answers the task's tenant only (another tenant gets the 404 of a
missing task). A Node on in-memory ledgers with a WorkerLink and the HTTP API in process,
driven by :class:`tests.support.fake_worker.FakeWorker`; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.secured_link import SecuredBroker, assigned_attempt, frames_broker
from wire import worker_protocol as p


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[SecuredBroker]:
    async with frames_broker(tmp_path, "output") as harness:
        yield harness


async def test_output_is_kept_only_from_the_attempts_connection_and_read_by_its_tenant(
    broker: SecuredBroker, caplog: pytest.LogCaptureFixture
) -> None:
    attempt = await assigned_attempt(broker)
    alice, bob, owner, other = attempt.alice, attempt.bob, attempt.owner, attempt.other
    assert attempt.welcome.output  # this broker takes Output frames
    task_id = attempt.task_id
    path = f"/api/v1/tasks/{task_id}/logs"

    # Another worker writes into alice's running attempt: refused and logged.
    with caplog.at_level(logging.WARNING, logger="broker.workers.worker_link"):
        other.send(p.Output(task_id=task_id, attempt=1, data=b"forged by w2\n"))
        other.finish_ok(999, 1)  # a round trip: the Output before it was handled
        await other.expect(p.FinishAck)
    assert (task_id, 1) not in broker.outputs
    assert any("refused output" in r.getMessage() for r in caplog.records)
    assert any("127.0.0.1" in r.getMessage() for r in caplog.records)

    # The owner's output while running, then its final tail before the report.
    owner.send(p.Output(task_id=task_id, attempt=1, data=b"alice's first line\n"))
    owner.send(
        p.Output(task_id=task_id, attempt=1, data=b"alice's first line\nand last\n", complete=True)
    )
    owner.finish_ok(task_id, 1)
    await owner.expect(p.FinishAck)
    answer = await broker.get(alice, path)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"] == "alice's first line\nand last\n"
    assert answer.json()["complete"] is True
    # A later frame (even from the owner's connection) cannot rewrite an ended attempt's.
    owner.send(p.Output(task_id=task_id, attempt=1, offset=100, data=b"late\n"))
    owner.finish_ok(999, 1)
    await owner.expect(p.FinishAck)
    assert "late" not in (await broker.get(alice, path)).json()["output"]

    # Bob: the same answer as for a task that does not exist.
    refused = await broker.get(bob, path)
    missing = await broker.get(bob, "/api/v1/tasks/999999/logs")
    assert refused.status_code == missing.status_code == 404
    assert refused.json()["error"]["code"] == "not_found"
    assert "alice" not in refused.text


async def test_an_oversized_output_frame_is_a_protocol_error(broker: SecuredBroker) -> None:
    worker = broker.worker("w1")
    await worker.hello()
    task_id = await broker.submit("alice")
    await worker.expect(p.Assign)
    too_big = p.Output(task_id=task_id, attempt=1, data=b"x" * (p.MAX_OUTPUT_BYTES + 1))
    worker.send(too_big)
    error = await worker.expect(p.Error)
    assert error.code == "output_too_large"
    await worker.wait_closed_by_peer()
    assert (task_id, 1) not in broker.outputs


async def test_a_leader_without_the_output_asks_the_worker_that_ran_it(
    broker: SecuredBroker,
) -> None:
    alice = await broker.tenant_token("alice")
    worker = broker.worker("w1")
    await worker.connect()
    worker.send(
        p.Hello(worker_id="w1", token=broker.worker_token, task_types={"*": 1}, output=True)
    )
    await worker.expect(p.Welcome)
    worker.start_heartbeats()
    task_id = await broker.submit("alice")
    await worker.expect(p.Assign)
    worker.finish_ok(task_id, 1)
    await worker.expect(p.FinishAck)
    assert (task_id, 1) not in broker.outputs  # as on a new leader after a failover

    async def answer_fetch() -> None:
        fetch = await worker.expect(p.FetchOutput)
        assert fetch.tasks == (p.TaskAttempt(task_id, 1),)
        worker.send(p.Output(task_id=task_id, attempt=1, data=b"kept by w1\n", complete=True))

    answering = asyncio.create_task(answer_fetch())
    answer = await broker.get(alice, f"/api/v1/tasks/{task_id}/logs")
    await asyncio.wait_for(answering, 5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"] == "kept by w1\n" and answer.json()["available"] is True


async def test_an_older_worker_is_never_asked_for_output(broker: SecuredBroker) -> None:
    """A worker whose Hello does not offer output would drop the connection on a
    FetchOutput frame it cannot decode: the leader answers without asking it."""
    alice = await broker.tenant_token("alice")
    worker = broker.worker("w1")
    welcome = await worker.hello()  # FakeWorker's Hello: no output=True
    assert welcome.output
    task_id = await broker.submit("alice")
    await worker.expect(p.Assign)
    worker.finish_ok(task_id, 1)
    await worker.expect(p.FinishAck)
    answer = await broker.get(alice, f"/api/v1/tasks/{task_id}/logs")
    assert answer.status_code == 200, answer.text
    assert answer.json()["available"] is False and answer.json()["complete"] is True
    await worker.expect_none(p.FetchOutput)
