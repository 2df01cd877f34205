"""Idempotency keys on SubmitTasks (broker/core/state.py): a retried submission replays
the first result instead of creating tasks again, deterministically on every replica."""

from __future__ import annotations

from typing import Any, Final

import msgspec
import pytest

from broker.core import (
    IDEMPOTENCY_MIN_RETENTION_MS,
    ErrorCode,
    Rejected,
    ReplayedResults,
    StateMachine,
    TaskRef,
)
from broker.core import entries as e

T0: Final = 1_700_000_000_000
HOUR_MS: Final = 3600 * 1000


class Machine:
    def __init__(self, machine: StateMachine | None = None) -> None:
        self.m = machine if machine is not None else StateMachine()
        self.now = max(T0, self.m.now_ms)
        self.next_id = self.m.max_task_id

    def spec(self, tenant: str = "t", **fields: Any) -> e.TaskSpec:
        self.next_id += 1
        return e.TaskSpec(id=self.next_id, type=fields.pop("type", "py"), tenant=tenant, **fields)

    def submit(
        self, key: str | None, *specs: e.TaskSpec, advance_ms: int = 0
    ) -> list[TaskRef | Rejected]:
        self.now += advance_ms
        entry = e.SubmitTasks(time_ms=self.now, tasks=specs, idempotency_key=key)
        # Followers apply the decoded entry: the key must survive the log.
        assert e.decode_entry(e.encode_entry(entry)) == entry
        result = self.m.apply(entry).result
        self.m.check_invariants()
        assert isinstance(result, list)
        return result

    def tick(self, advance_ms: int) -> None:
        self.now += advance_ms
        self.m.apply(e.Tick(time_ms=self.now))
        self.m.check_invariants()


@pytest.fixture
def sm() -> Machine:
    return Machine()


def test_repeated_key_replays_the_first_result_and_creates_nothing(sm: Machine) -> None:
    first = sm.submit("k1", sm.spec(), sm.spec(tenant="u"))
    assert first == [TaskRef(1, "waiting"), TaskRef(2, "waiting")]
    assert not isinstance(first, ReplayedResults)
    digest_tasks = dict(sm.m.tasks)
    again = sm.submit("k1", sm.spec(), sm.spec(tenant="u"), advance_ms=1_000)
    assert isinstance(again, ReplayedResults)
    assert again == first
    assert sm.m.tasks == digest_tasks
    # The replay's stamped ids are used up: a later submission cannot reuse them.
    assert sm.m.max_task_id == 4
    assert sm.submit(None, e.TaskSpec(id=4, type="py", tenant="t"))[0] == Rejected(
        ErrorCode.INVALID, "task id 4 was already used"
    )


def test_replay_returns_the_first_states_even_after_they_changed(sm: Machine) -> None:
    (ref,) = sm.submit("k", sm.spec())
    assert isinstance(ref, TaskRef)
    sm.m.apply(e.CancelTask(time_ms=sm.now, task_id=ref.id))
    assert sm.submit("k", sm.spec()) == [TaskRef(ref.id, "waiting")]


def test_a_different_key_or_no_key_creates_tasks(sm: Machine) -> None:
    sm.submit("k1", sm.spec())
    assert sm.submit("k2", sm.spec()) == [TaskRef(2, "waiting")]
    assert sm.submit(None, sm.spec()) == [TaskRef(3, "waiting")]
    assert sm.submit(None, sm.spec()) == [TaskRef(4, "waiting")]
    assert list(sm.m.idempotency) == [("t", "k1"), ("t", "k2")]


def test_batch_with_rejected_items_replays_them_too(sm: Machine) -> None:
    first = sm.submit("batch", sm.spec(slot="s"), sm.spec(slot="s"), sm.spec(type=".bad"))
    assert isinstance(first[0], TaskRef)
    assert isinstance(first[1], Rejected) and first[1].code is ErrorCode.SLOT_BUSY
    assert isinstance(first[2], Rejected) and first[2].code is ErrorCode.INVALID
    count = len(sm.m.tasks)
    again = sm.submit("batch", sm.spec(slot="t"), sm.spec(slot="u"), sm.spec())
    assert again == first
    assert len(sm.m.tasks) == count


def test_a_submission_that_created_nothing_is_not_remembered(sm: Machine) -> None:
    sm.m.apply(e.SetTenant(time_ms=sm.now, tenant="t", limits=e.TenantLimitsPatch(max_waiting=1)))
    sm.submit(None, sm.spec())
    (full,) = sm.submit("k", sm.spec())
    assert isinstance(full, Rejected) and full.code is ErrorCode.TENANT_QUEUE_FULL
    assert ("t", "k") not in sm.m.idempotency
    sm.m.apply(e.SetTenant(time_ms=sm.now, tenant="t", limits=e.TenantLimitsPatch(max_waiting=0)))
    (created,) = sm.submit("k", sm.spec())
    assert isinstance(created, TaskRef)
    assert sm.submit("k", sm.spec()) == [created]


@pytest.mark.parametrize("key", ["", "x" * 129, "caf\u00e9", "tab\there", "nl\n"])
def test_invalid_key_is_rejected_and_creates_nothing(sm: Machine, key: str) -> None:
    results = sm.submit(key, sm.spec(), sm.spec())
    assert [r.code for r in results if isinstance(r, Rejected)] == [ErrorCode.INVALID] * 2
    assert not sm.m.tasks
    assert not sm.m.idempotency


@pytest.mark.parametrize("key", ["a", "x" * 128, " !~", "550e8400-e29b-41d4-a716-446655440000"])
def test_valid_keys(sm: Machine, key: str) -> None:
    assert isinstance(sm.submit(key, sm.spec())[0], TaskRef)
    assert ("t", key) in sm.m.idempotency


def test_keys_expire_after_24_hours_by_entry_time(sm: Machine) -> None:
    sm.submit("old", sm.spec())
    sm.submit("newer", sm.spec(), advance_ms=HOUR_MS)
    sm.tick(IDEMPOTENCY_MIN_RETENTION_MS - HOUR_MS - 1)
    assert list(sm.m.idempotency) == [("t", "old"), ("t", "newer")]
    sm.tick(1)  # 24 h after the first use of "old"
    assert list(sm.m.idempotency) == [("t", "newer")]
    # Forgotten: the same key now creates new tasks (the old ones may be purged too).
    assert sm.submit("old", sm.spec()) == [TaskRef(3, "waiting")]
    sm.tick(HOUR_MS)
    assert list(sm.m.idempotency) == [("t", "old")]


def test_keys_live_as_long_as_finished_tasks_when_that_is_longer(sm: Machine) -> None:
    retention_ms = 3 * IDEMPOTENCY_MIN_RETENTION_MS
    sm.m.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=retention_ms))
    sm.submit("k", sm.spec())
    sm.tick(retention_ms - 1)
    assert ("t", "k") in sm.m.idempotency
    sm.tick(1)
    assert ("t", "k") not in sm.m.idempotency


def test_short_retention_still_keeps_keys_24_hours(sm: Machine) -> None:
    sm.m.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=1_000))
    sm.submit("k", sm.spec())
    sm.tick(IDEMPOTENCY_MIN_RETENTION_MS - 1)
    assert sm.m.idempotency_retention_ms() == IDEMPOTENCY_MIN_RETENTION_MS
    assert sm.submit("k", sm.spec()) == [TaskRef(1, "waiting")]
    assert len(sm.m.tasks) == 1


def test_keys_survive_a_snapshot_and_expire_alike(sm: Machine) -> None:
    sm.submit("a", sm.spec())
    sm.submit("b", sm.spec(), sm.spec(type=".bad"), advance_ms=HOUR_MS)
    data = sm.m.encode_snapshot()
    loaded = Machine(StateMachine.from_snapshot(data))
    loaded.m.check_invariants()
    assert loaded.m.encode_snapshot() == data
    assert loaded.m.digest() == sm.m.digest()
    for machine in (sm, loaded):
        assert machine.submit("b", machine.spec()) == [
            TaskRef(2, "waiting"),
            Rejected(
                ErrorCode.INVALID, "type must be 1-128 characters of letters, digits and _ . : -"
            ),
        ]
        machine.tick(IDEMPOTENCY_MIN_RETENTION_MS - HOUR_MS)
        assert list(machine.m.idempotency) == [("t", "b")]
    assert loaded.m.digest() == sm.m.digest()


def test_keys_are_part_of_the_digest() -> None:
    a, b = Machine(), Machine()
    a.submit("k", a.spec())
    b.submit("other", b.spec())
    assert a.m.digest() != b.m.digest()


def test_snapshot_without_keys_still_loads() -> None:
    # A snapshot written before idempotency keys existed has no "idempotency" field.
    sm = Machine()
    sm.submit(None, sm.spec())
    body = msgspec.msgpack.decode(sm.m.encode_snapshot())
    del body["idempotency"]
    loaded = StateMachine.from_snapshot(msgspec.msgpack.encode(body))
    assert not loaded.idempotency
    assert loaded.digest() == sm.m.digest()


def test_old_submit_entries_without_a_key_still_decode() -> None:
    data = msgspec.msgpack.encode(
        {"type": "submit", "time_ms": 1, "tasks": [{"id": 1, "type": "py", "tenant": "t"}]}
    )
    entry = e.decode_entry(data)
    assert isinstance(entry, e.SubmitTasks) and entry.idempotency_key is None
    keyed = e.SubmitTasks(time_ms=1, idempotency_key=None)
    assert "idempotency_key" not in msgspec.msgpack.decode(e.encode_entry(keyed))
