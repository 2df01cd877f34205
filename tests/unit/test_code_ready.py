"""Runnable gating by code readiness (docs/DESIGN.md §7) in the pure state machine and scheduler.

An artifact logged with ``AddCode(ready=False)`` keeps the tasks that use it waiting but
out of the scheduler's queues ("parked") until ``CodeReady``; then they join their
tenants' queues in id order. Invariants are checked after every entry.
"""

from __future__ import annotations

from typing import Final

import msgspec

from broker.core import Artifact, ErrorCode, Rejected, StateMachine, TaskRef, TaskState
from broker.core import entries as e
from broker.core.scheduler import schedule
from tests.support.machine import Machine, code

SHA: Final = "ab" * 32
OTHER: Final = "cd" * 32


def add_code(sm: Machine, sha256: str = SHA, *, ready: bool) -> Artifact:
    entry = e.AddCode(time_ms=sm.now, sha256=sha256, name="job.py", size_bytes=10, ready=ready)
    result = sm.apply(entry)
    assert isinstance(result, Artifact), result
    return result


def code_ready(sm: Machine, sha256: str = SHA) -> object:
    return sm.apply(e.CodeReady(time_ms=sm.at(5), sha256=sha256))


def with_worker(sm: Machine) -> Machine:
    sm.apply(
        e.RegisterWorker(
            time_ms=sm.now, worker_id="w1", resources={"cpu": 8.0}, task_types={"*": 8}
        )
    )
    return sm


def scheduled(sm: Machine) -> list[int]:
    return [a.task_id for a in schedule(sm.m)]


def test_old_entries_and_the_default_are_ready() -> None:
    # An AddCode written before the flag existed decodes as ready.
    old = b"\x85\xa4type\xa8code_add\xa7time_ms\x01\xa6sha256\xd9@" + SHA.encode()
    old += b"\xa4name\xa6job.py\xaasize_bytes\x0a"
    entry = e.decode_entry(old)
    assert isinstance(entry, e.AddCode) and entry.ready
    # And ready=True is left out of the encoding: new entries of ready code are unchanged.
    assert b"ready" not in e.encode_entry(e.AddCode(time_ms=1, sha256=SHA))
    assert b"ready" in e.encode_entry(e.AddCode(time_ms=1, sha256=SHA, ready=False))


def test_tasks_of_unready_code_wait_outside_the_queues() -> None:
    sm = with_worker(Machine())
    add_code(sm, ready=False)
    plain = sm.add()
    gated = sm.add(code=SHA)
    assert sm.state(gated) == TaskState.WAITING
    assert sm.waiting() == [plain]
    assert sm.m.parked == {SHA: {gated: None}}
    assert scheduled(sm) == [plain]
    # Even an explicit assignment is refused (apply is the authority, not the scheduler).
    assert code(sm.assign(gated)) == ErrorCode.STALE
    assert sm.state(gated) == TaskState.WAITING


def test_code_ready_releases_in_id_order_after_the_queue() -> None:
    sm = with_worker(Machine())
    add_code(sm, ready=False)
    first = sm.add(code=SHA)
    plain = sm.add()
    second = sm.add(code=SHA)
    other_tenant = sm.add("u", code=SHA)
    result = code_ready(sm)
    assert isinstance(result, Artifact) and result.ready
    assert sm.m.parked == {}
    assert sm.waiting() == [plain, first, second]
    assert sm.waiting("u") == [other_tenant]
    assert sorted(scheduled(sm)) == sorted([plain, first, second, other_tenant])
    # Idempotent: a second CodeReady changes nothing but the clock.
    tasks = msgspec.msgpack.encode(sm.m.snapshot_body().tasks)
    assert isinstance(code_ready(sm), Artifact)
    assert msgspec.msgpack.encode(sm.m.snapshot_body().tasks) == tasks
    assert sm.waiting() == [plain, first, second]


def test_code_ready_rejects_unknown_and_invalid() -> None:
    sm = Machine()
    assert code(code_ready(sm, OTHER)) == ErrorCode.NOT_FOUND
    assert code(code_ready(sm, "xyz")) == ErrorCode.INVALID


def test_ready_upload_of_an_unready_artifact_releases_it() -> None:
    sm = Machine()
    add_code(sm, ready=False)
    gated = sm.add(code=SHA)
    add_code(sm, ready=False)  # again, still not ready
    assert sm.m.parked == {SHA: {gated: None}}
    assert add_code(sm, ready=True).ready
    assert sm.waiting() == [gated]
    # Readiness never goes back.
    assert add_code(sm, ready=False).ready


def test_parked_tasks_leave_cleanly() -> None:
    """Cancel, deadline, delayed start, transaction commit and purge of parked tasks."""
    sm = Machine()
    sm.set_tenant(max_waiting=0)
    add_code(sm, ready=False)
    cancelled = sm.add(code=SHA)
    expiring = sm.add(code=SHA, deadline_ms=sm.now + 100)
    delayed = sm.add(code=SHA, start_after_ms=sm.now + 50)
    txn = sm.begin()
    pending = sm.add(code=SHA, transaction=txn)
    assert isinstance(sm.cancel(cancelled), TaskRef)
    sm.tick(60)  # the delayed one becomes waiting: parked, not queued
    assert sm.state(delayed) == TaskState.WAITING
    assert sm.apply(e.CommitTransaction(time_ms=sm.now, transaction_id=txn)) is not None
    assert set(sm.m.parked[SHA]) == {expiring, delayed, pending}
    sm.tick(100)  # the deadline fires
    assert sm.state(expiring) == TaskState.ERROR
    assert set(sm.m.parked[SHA]) == {delayed, pending}
    assert sm.waiting() == []
    code_ready(sm)
    assert sm.waiting() == [delayed, pending]


def test_snapshot_keeps_the_flag_and_the_parking() -> None:
    sm = with_worker(Machine())
    add_code(sm, ready=False)
    add_code(sm, OTHER, ready=True)
    gated = sm.add(code=SHA)
    plain = sm.add(code=OTHER)
    data = sm.m.encode_snapshot()
    loaded = StateMachine.from_snapshot(data)
    loaded.check_invariants()
    assert loaded.encode_snapshot() == data
    assert loaded.digest() == sm.m.digest()
    assert not loaded.artifacts[SHA].ready and loaded.artifacts[OTHER].ready
    assert loaded.parked == {SHA: {gated: None}}
    assert list(loaded.waiting["t"]) == [plain]
    # The flag is part of the digest: a replica that saw CodeReady differs.
    replica = Machine(StateMachine.from_snapshot(data))
    code_ready(replica)
    assert replica.m.digest() != loaded.digest()
    assert list(replica.m.waiting["t"]) == [plain, gated]


def test_running_tasks_are_retried_into_the_queue() -> None:
    # A task that ran (its code was ready) and is retried goes back to its queue.
    sm = with_worker(Machine())
    add_code(sm, ready=True)
    task_id = sm.add(code=SHA, max_attempts=2)
    assert isinstance(sm.assign(task_id), TaskRef)
    (result,) = sm.finish(sm.outcome(task_id, ok=False))
    assert isinstance(result, TaskRef) and result.state == TaskState.WAITING
    assert sm.waiting() == [task_id]
    assert not isinstance(sm.assign(task_id), Rejected)
