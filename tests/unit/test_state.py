"""Rules of the replicated state machine (broker/core/state.py) and its entries
(broker/core/entries.py).

Each test is a small hand-built scenario; ``check_invariants()`` runs after
every entry applied through ``Machine.apply``.
"""

from __future__ import annotations

import math
from typing import Any, Final

import msgspec
import pytest

from broker.core import (
    Artifact,
    ErrorCode,
    Rejected,
    StateMachine,
    TaskRef,
    TaskState,
    Tenant,
    TransactionDone,
    WorkerReconciled,
    validate_task_spec,
)
from broker.core import entries as e
from tests.support.machine import T0, Machine, code


@pytest.fixture
def sm() -> Machine:
    return Machine()


# --- submit, delayed start ---------------------------------------------------------------


def test_submit_makes_a_waiting_task(sm: Machine) -> None:
    result = sm.submit_one(params=b'{"x": 1}', resources={"cpu": 1.5})
    assert result == TaskRef(1, TaskState.WAITING)
    task = sm.m.tasks[1]
    assert (task.state, task.attempt, task.worker, task.created_ms) == ("waiting", 0, None, T0)
    assert task.params == b'{"x": 1}' and task.resources == {"cpu": 1.5}
    assert sm.waiting() == [1]
    assert sm.m.count_by_state()["waiting"] == 1
    # The tenant was created with the default limits.
    assert sm.m.tenants["t"] == Tenant("t", max_waiting=0, max_running=0, weight=1.0)


def test_start_after_delays_until_a_tick_past_it(sm: Machine) -> None:
    task_id = sm.add(start_after_ms=T0 + 1_000)
    assert sm.state(task_id) == "delayed"
    assert sm.waiting() == []
    sm.tick(999)
    assert sm.state(task_id) == "delayed"
    sm.tick(1)  # exactly at start_after
    assert sm.state(task_id) == "waiting"
    assert sm.waiting() == [task_id]


def test_start_after_in_the_past_is_waiting_at_once(sm: Machine) -> None:
    assert sm.submit_one(start_after_ms=T0) == TaskRef(1, TaskState.WAITING)
    assert sm.submit_one(start_after_ms=T0 - 5) == TaskRef(2, TaskState.WAITING)


def test_delayed_tasks_start_in_start_after_order_on_one_jump(sm: Machine) -> None:
    late = sm.add(start_after_ms=T0 + 300)
    early = sm.add(start_after_ms=T0 + 100)
    sm.tick(1_000)
    assert sm.waiting() == [early, late]


def test_time_never_goes_back(sm: Machine) -> None:
    sm.tick(1_000)
    assert sm.apply(e.Tick(time_ms=T0)) is None
    assert sm.m.now_ms == T0 + 1_000
    assert sm.apply(e.SubmitTasks(time_ms=T0, tasks=(sm.spec(),))) == [TaskRef(1, "waiting")]
    assert sm.m.tasks[1].created_ms == T0 + 1_000


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"type": ""}, "type"),
        ({"type": "bad type"}, "type"),
        ({"type": ".py"}, "type"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "-x"}, "tenant"),
        ({"tenant": "x" * 65}, "tenant"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": 1001}, "max_attempts"),
        ({"resources": {"cpu": -1.0}}, "cpu"),
        ({"resources": {"cpu": math.nan}}, "cpu"),
        ({"resources": {"cpu": math.inf}}, "cpu"),
        ({"resources": {"bad name": 1.0}}, "bad name"),
        ({"resources": {f"r{i}": 1.0 for i in range(33)}}, "resources"),
        ({"slot": ""}, "slot"),
        ({"slot": "s" * 257}, "slot"),
        ({"code": "not-a-sha"}, "code"),
        ({"deadline_ms": T0}, "deadline"),
    ],
)
def test_invalid_specs_are_rejected(sm: Machine, fields: dict[str, Any], problem: str) -> None:
    tenant = fields.pop("tenant", "t")
    result = sm.submit_one(tenant, **fields)
    assert code(result) == ErrorCode.INVALID
    assert isinstance(result, Rejected) and problem in result.message
    assert sm.m.tasks == {}


def test_code_must_be_uploaded_before_use(sm: Machine) -> None:
    sha = "ab" * 32
    assert code(sm.submit_one(code=sha)) == ErrorCode.NOT_FOUND
    added = sm.apply(e.AddCode(time_ms=sm.now, sha256=sha, name="job.py", size_bytes=10))
    assert added == Artifact(sha, "job.py", 10, T0)
    assert isinstance(sm.submit_one(code=sha), TaskRef)
    bad = sm.apply(e.AddCode(time_ms=sm.now, sha256=sha.upper(), name="job.py"))
    assert code(bad) == ErrorCode.INVALID


def test_reused_and_decreasing_task_ids_are_rejected(sm: Machine) -> None:
    sm.add(id=5)
    assert code(sm.submit_one(id=5)) == ErrorCode.INVALID
    assert code(sm.submit_one(id=3)) == ErrorCode.INVALID
    # An id is used up even by an invalid spec.
    assert code(sm.submit_one(id=7, max_attempts=0)) == ErrorCode.INVALID
    assert code(sm.submit_one(id=7)) == ErrorCode.INVALID
    assert sm.submit_one(id=8) == TaskRef(8, "waiting")
    assert sorted(sm.m.tasks) == [5, 8]


def test_batch_results_are_per_task(sm: Machine) -> None:
    results = sm.submit(sm.spec(slot="s"), sm.spec(max_attempts=0), sm.spec(slot="s"), sm.spec())
    assert isinstance(results[0], TaskRef) and isinstance(results[3], TaskRef)
    assert [code(results[1]), code(results[2])] == [ErrorCode.INVALID, ErrorCode.SLOT_BUSY]


# --- slots ---------------------------------------------------------------------------------


def _end_running(sm: Machine, task_id: int, how: str) -> None:
    if how == "finish":
        assert sm.finish(sm.outcome(task_id)) == [TaskRef(task_id, "finished")]
    elif how == "cancel":
        assert sm.cancel(task_id) == TaskRef(task_id, "cancelled")
    elif how == "error":
        assert sm.finish(sm.outcome(task_id, ok=False)) == [TaskRef(task_id, "error")]
    elif how == "deadline":
        sm.tick(60_000)
        assert sm.state(task_id) == "error"
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["finish", "cancel", "error", "deadline"])
def test_slot_is_busy_while_live_and_freed_when_the_task_ends(sm: Machine, how: str) -> None:
    sm.register()
    holder = sm.add(slot="nightly", deadline_ms=T0 + 60_000)
    assert code(sm.submit_one(slot="nightly")) == ErrorCode.SLOT_BUSY
    # Slot names are the tenant's own: another tenant's "nightly" is another slot.
    other = sm.submit_one("other-tenant", slot="nightly")
    assert isinstance(other, TaskRef)
    assert code(sm.submit_one("other-tenant", slot="nightly")) == ErrorCode.SLOT_BUSY
    assert isinstance(sm.assign(holder), TaskRef)
    assert code(sm.submit_one(slot="nightly")) == ErrorCode.SLOT_BUSY
    _end_running(sm, holder, how)
    assert ("t", "nightly") not in sm.m.slots
    assert sm.m.slots[("other-tenant", "nightly")] == other.id
    assert isinstance(sm.submit_one(slot="nightly"), TaskRef)


def test_slot_is_held_by_delayed_and_pending_tasks_and_freed_by_rollback(sm: Machine) -> None:
    sm.add(slot="a", start_after_ms=T0 + 10_000)
    assert code(sm.submit_one(slot="a")) == ErrorCode.SLOT_BUSY
    txn = sm.begin()
    sm.add(slot="b", transaction=txn)
    assert code(sm.submit_one(slot="b")) == ErrorCode.SLOT_BUSY
    assert isinstance(
        sm.apply(e.RollbackTransaction(time_ms=sm.now, transaction_id=txn)), TransactionDone
    )
    assert isinstance(sm.submit_one(slot="b"), TaskRef)


def test_slot_freed_after_retry_exhaustion_but_not_on_retry(sm: Machine) -> None:
    sm.register()
    task_id = sm.add(slot="s", max_attempts=2)
    sm.assign(task_id)
    assert sm.finish(sm.outcome(task_id, ok=False)) == [TaskRef(task_id, "waiting")]
    assert code(sm.submit_one(slot="s")) == ErrorCode.SLOT_BUSY  # still live
    sm.assign(task_id)
    assert sm.finish(sm.outcome(task_id, ok=False)) == [TaskRef(task_id, "error")]
    assert isinstance(sm.submit_one(slot="s"), TaskRef)


# --- tenant limits -------------------------------------------------------------------------


def test_max_waiting_counts_pending_delayed_and_waiting(sm: Machine) -> None:
    sm.register()
    assert isinstance(sm.set_tenant(max_waiting=3), Tenant)
    txn = sm.begin()
    sm.add(transaction=txn)
    sm.add(start_after_ms=T0 + 5_000)
    running = sm.add()
    sm.assign(running)  # running tasks do not count
    sm.add()
    result = sm.submit_one()
    assert code(result) == ErrorCode.TENANT_QUEUE_FULL
    assert isinstance(result, Rejected) and "max_waiting" in result.message
    # Other tenants are not affected.
    assert isinstance(sm.submit_one("other"), TaskRef)


def test_max_waiting_changes_are_effective_at_once(sm: Machine) -> None:
    for _ in range(3):
        sm.add()
    # Lowering it below the current count: nothing is evicted, the next submission is refused.
    assert sm.set_tenant(max_waiting=2) == Tenant("t", max_waiting=2)
    assert code(sm.submit_one()) == ErrorCode.TENANT_QUEUE_FULL
    assert len(sm.waiting()) == 3
    # Raising it allows again, up to the new limit.
    sm.set_tenant(max_waiting=4)
    assert isinstance(sm.submit_one(), TaskRef)
    assert code(sm.submit_one()) == ErrorCode.TENANT_QUEUE_FULL
    # 0 means unlimited.
    sm.set_tenant(max_waiting=0)
    assert isinstance(sm.submit_one(), TaskRef)


def test_tenant_patch_keeps_unset_fields(sm: Machine) -> None:
    assert sm.set_tenant(max_waiting=5, max_running=2, weight=3.0) == Tenant("t", 5, 2, 3.0)
    assert sm.set_tenant(weight=0.5) == Tenant("t", 5, 2, 0.5)
    assert sm.set_tenant() == Tenant("t", 5, 2, 0.5)


@pytest.mark.parametrize(
    ("tenant", "limits", "problem"),
    [
        ("t", {"weight": 0.0}, "weight"),
        ("t", {"weight": -1.0}, "weight"),
        ("t", {"weight": math.nan}, "weight"),
        ("t", {"weight": math.inf}, "weight"),
        ("t", {"max_running": -1}, "max_running"),
        ("t", {"max_waiting": -1}, "max_waiting"),
        ("bad name", {"weight": 2.0}, "tenant"),
        ("", {}, "tenant"),
    ],
)
def test_invalid_tenant_limits_are_rejected(
    sm: Machine, tenant: str, limits: dict[str, Any], problem: str
) -> None:
    sm.set_tenant(max_running=3, weight=2.0)
    result = sm.set_tenant(tenant, **limits)
    assert code(result) == ErrorCode.INVALID
    assert isinstance(result, Rejected) and problem in result.message
    assert sm.m.tenants["t"] == Tenant("t", 0, 3, 2.0)  # unchanged


# --- transactions ----------------------------------------------------------------------------


def test_commit_makes_all_tasks_runnable_in_one_entry(sm: Machine) -> None:
    txn = sm.begin(ttl_ms=60_000)
    a = sm.add(transaction=txn)
    b = sm.add(transaction=txn, start_after_ms=T0 + 30_000)
    c = sm.add(transaction=txn)
    assert [sm.state(i) for i in (a, b, c)] == ["pending"] * 3
    assert sm.waiting() == []
    sm.tick(1_000)
    result = sm.apply(e.CommitTransaction(time_ms=sm.now, transaction_id=txn))
    assert result == TransactionDone(txn, "committed", (a, b, c))
    assert [sm.state(i) for i in (a, b, c)] == ["waiting", "delayed", "waiting"]
    assert sm.waiting() == [a, c]
    assert txn not in sm.m.transactions
    assert all(sm.m.tasks[i].transaction is None for i in (a, b, c))
    sm.tick(30_000)
    assert sm.waiting() == [a, c, b]
    # The transaction is closed now.
    again = sm.apply(e.CommitTransaction(time_ms=sm.now, transaction_id=txn))
    assert code(again) == ErrorCode.NOT_FOUND
    assert code(sm.submit_one(transaction=txn)) == ErrorCode.NOT_FOUND


def test_rollback_deletes_the_pending_tasks(sm: Machine) -> None:
    txn = sm.begin()
    a = sm.add(transaction=txn, slot="s")
    b = sm.add(transaction=txn)
    outside = sm.add()
    result = sm.apply(e.RollbackTransaction(time_ms=sm.now, transaction_id=txn))
    assert result == TransactionDone(txn, "rolled_back", (a, b))
    assert sorted(sm.m.tasks) == [outside]
    assert sm.m.count_by_state()["pending"] == 0
    assert sm.m.tenant_counts_view("t")["pending"] == 0
    assert code(sm.apply(e.RollbackTransaction(time_ms=sm.now, transaction_id=txn))) == (
        ErrorCode.NOT_FOUND
    )


def test_cancelled_pending_task_leaves_its_transaction(sm: Machine) -> None:
    txn = sm.begin()
    a = sm.add(transaction=txn)
    b = sm.add(transaction=txn)
    assert sm.cancel(a) == TaskRef(a, "cancelled")
    result = sm.apply(e.CommitTransaction(time_ms=sm.now, transaction_id=txn))
    assert result == TransactionDone(txn, "committed", (b,))
    assert sm.state(a) == "cancelled"


def test_transaction_expires_after_its_ttl(sm: Machine) -> None:
    txn = sm.begin(ttl_ms=5_000)
    task_id = sm.add(transaction=txn)
    sm.tick(4_999)
    assert sm.state(task_id) == "pending"
    sm.tick(1)
    assert task_id not in sm.m.tasks
    assert txn not in sm.m.transactions
    assert code(sm.apply(e.CommitTransaction(time_ms=sm.now, transaction_id=txn))) == (
        ErrorCode.NOT_FOUND
    )


def test_expiry_fires_before_a_deadline_due_at_the_same_time(sm: Machine) -> None:
    # Timers fire in (due, kind, id) order: the transaction expires first, so its
    # task is deleted rather than failed by its deadline.
    txn = sm.begin(ttl_ms=5_000)
    task_id = sm.add(transaction=txn, deadline_ms=T0 + 5_000)
    sm.tick(10_000)
    assert task_id not in sm.m.tasks


def test_transaction_rules(sm: Machine) -> None:
    txn = sm.begin("t")
    # Another tenant's transaction answers as one that is not open (its owner unsaid).
    result = sm.submit_one("other", transaction=txn)
    assert code(result) == ErrorCode.NOT_FOUND and isinstance(result, Rejected)
    assert result.message == f"transaction {txn} is not open"
    assert code(sm.submit_one(transaction=999)) == ErrorCode.NOT_FOUND
    for other in (e.CommitTransaction, e.RollbackTransaction):
        refused = sm.apply(other(time_ms=sm.now, transaction_id=txn, tenant="other"))
        assert code(refused) == ErrorCode.NOT_FOUND
    assert txn in sm.m.transactions
    reused = e.BeginTransaction(time_ms=sm.now, transaction_id=txn, tenant="t")
    assert code(sm.apply(reused)) == ErrorCode.INVALID
    for tenant, ttl in (("bad name", 1_000), ("t", 0), ("t", -1)):
        entry = e.BeginTransaction(
            time_ms=sm.now, transaction_id=100 + ttl, tenant=tenant, ttl_ms=ttl
        )
        assert code(sm.apply(entry)) == ErrorCode.INVALID


# --- deadlines -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["waiting", "delayed", "running", "pending"])
def test_deadline_turns_a_live_task_to_error(sm: Machine, where: str) -> None:
    sm.register()
    fields: dict[str, Any] = {"deadline_ms": T0 + 1_000, "slot": "s"}
    if where == "delayed":
        fields["start_after_ms"] = T0 + 5_000
    if where == "pending":
        fields["transaction"] = sm.begin(ttl_ms=60_000)
    task_id = sm.add(**fields)
    if where == "running":
        sm.assign(task_id)
    sm.tick(999)
    assert sm.state(task_id) == where
    sm.tick(1)
    task = sm.m.tasks[task_id]
    assert (task.state, task.error, task.finished_ms) == ("error", "deadline exceeded", T0 + 1_000)
    assert sm.m.running_by_worker.get("w1", set()) == set()
    assert sm.m.slots == {}
    if where == "running":
        assert sm.finish(sm.outcome(task_id, worker_id="w1", attempt=1)) == [
            Rejected(ErrorCode.STALE, f"task {task_id} not running")
        ]


def test_deadline_does_not_touch_final_tasks(sm: Machine) -> None:
    sm.register()
    task_id = sm.add(deadline_ms=T0 + 1_000)
    sm.assign(task_id)
    sm.finish(sm.outcome(task_id))
    sm.tick(2_000)
    assert sm.state(task_id) == "finished"
    assert sm.m.tasks[task_id].error is None


# --- workers, attempts -----------------------------------------------------------------------


def test_reregistered_worker_can_run_again(sm: Machine) -> None:
    sm.register("w1")
    sm.worker_dead("w1")
    task_id = sm.add()
    assert code(sm.assign(task_id)) == ErrorCode.STALE
    sm.register("w1")
    assert sm.assign(task_id) == TaskRef(task_id, "running")


def test_reconnecting_worker_keeps_reported_tasks_and_loses_the_others(sm: Machine) -> None:
    sm.register("w1")
    kept, lost, wrong_attempt = (sm.add(max_attempts=2) for _ in range(3))
    last = sm.add(max_attempts=2, max_lost=0)
    for task_id in (kept, lost, wrong_attempt):
        sm.assign(task_id)
    sm.assign(last)
    sm.finish(sm.outcome(last, ok=False))
    sm.assign(last)  # its second attempt; it may lose none
    reported = (
        e.TaskAttempt(kept, 1),
        e.TaskAttempt(wrong_attempt, 2),
        e.TaskAttempt(12345, 1),  # unknown to the state: ignored
    )
    result = sm.register("w1", running=reported)
    assert result == WorkerReconciled("w1", (e.TaskAttempt(kept, 1),), (lost, wrong_attempt, last))
    assert [sm.state(i) for i in (kept, lost, wrong_attempt, last)] == [
        "running",
        "waiting",
        "waiting",
        "error",
    ]
    assert (sm.m.tasks[lost].attempt, sm.m.tasks[lost].lost) == (1, 1)
    assert sm.m.running_by_worker["w1"] == {kept}
    error = sm.m.tasks[last].error
    assert error is not None and "came back without" in error and "max_lost 0" in error


def test_register_worker_needs_an_id(sm: Machine) -> None:
    assert code(sm.apply(e.RegisterWorker(time_ms=sm.now, worker_id=""))) == ErrorCode.INVALID


def test_failed_attempt_retries_at_the_back_of_the_queue(sm: Machine) -> None:
    sm.register()
    first, second = sm.add(max_attempts=3), sm.add(max_attempts=3)
    sm.assign(first)
    assert sm.finish(sm.outcome(first, ok=False)) == [TaskRef(first, "waiting")]
    assert sm.waiting() == [second, first]
    assert sm.m.tasks[first].error == "boom"


def test_assign_rejects_stale_assignments(sm: Machine) -> None:
    sm.register()
    task_id = sm.add()
    delayed = sm.add(start_after_ms=T0 + 1_000)
    assert code(sm.assign(task_id, "ghost")) == ErrorCode.STALE
    assert code(sm.assign(delayed)) == ErrorCode.STALE
    assert code(sm.assign(12345)) == ErrorCode.STALE
    entry = e.AssignTasks(
        time_ms=sm.now, assignments=(e.Assignment(task_id, "w1"), e.Assignment(task_id, "w1"))
    )
    result = sm.apply(entry)
    assert isinstance(result, list)
    assert result[0] == TaskRef(task_id, "running") and code(result[1]) == ErrorCode.STALE
    assert sm.m.tasks[task_id].attempt == 1


def test_finish_duplicates_and_stale_reports_are_rejected(sm: Machine) -> None:
    sm.register("w1")
    sm.register("w2")
    task_id = sm.add(max_attempts=2)
    sm.assign(task_id, "w1")
    good = sm.outcome(task_id)
    assert sm.finish(sm.outcome(task_id, worker_id="w2"))[0] == Rejected(
        ErrorCode.STALE, f"task {task_id} not running"
    )
    assert code(sm.finish(sm.outcome(task_id, attempt=2))[0]) == ErrorCode.STALE
    assert code(sm.finish(sm.outcome(task_id, attempt=0))[0]) == ErrorCode.STALE
    assert sm.state(task_id) == "running"
    # The good report and its duplicate in one entry, then once more later.
    first, duplicate = sm.finish(good, good)
    assert first == TaskRef(task_id, "finished")
    assert code(duplicate) == ErrorCode.STALE
    assert code(sm.finish(good)[0]) == ErrorCode.STALE
    task = sm.m.tasks[task_id]
    assert (task.state, task.result, task.attempt) == ("finished", b"42", 1)
    unknown = e.TaskOutcome(task_id=999, worker_id="w1", attempt=1, ok=True)
    assert code(sm.finish(unknown)[0]) == ErrorCode.STALE


def test_late_report_of_an_earlier_attempt_is_stale(sm: Machine) -> None:
    sm.register()
    task_id = sm.add(max_attempts=2)
    sm.assign(task_id)
    old = sm.outcome(task_id, ok=False)
    sm.finish(old)
    sm.assign(task_id)
    assert code(sm.finish(sm.outcome(task_id, attempt=1))[0]) == ErrorCode.STALE
    assert sm.state(task_id) == "running"


# --- cancel ----------------------------------------------------------------------------------


def test_cancel_rules(sm: Machine) -> None:
    sm.register()
    task_id = sm.add()
    sm.assign(task_id)
    assert sm.cancel(task_id) == TaskRef(task_id, "cancelled")
    task = sm.m.tasks[task_id]
    assert (task.error, task.finished_ms) == ("by test", sm.now)
    assert sm.m.running_by_worker["w1"] == set()
    # The worker's late report is stale; a second cancel is a conflict.
    assert code(sm.finish(sm.outcome(task_id, worker_id="w1", attempt=1))[0]) == ErrorCode.STALE
    assert code(sm.cancel(task_id)) == ErrorCode.CONFLICT
    assert code(sm.cancel(424242)) == ErrorCode.NOT_FOUND


@pytest.mark.parametrize("final", ["finished", "error"])
def test_cancel_of_a_final_task_is_a_conflict(sm: Machine, final: str) -> None:
    sm.register()
    task_id = sm.add()
    sm.assign(task_id)
    sm.finish(sm.outcome(task_id, ok=final == "finished"))
    result = sm.cancel(task_id)
    assert code(result) == ErrorCode.CONFLICT
    assert sm.state(task_id) == final


# --- purge -----------------------------------------------------------------------------------


def test_final_tasks_are_purged_after_the_retention(sm: Machine) -> None:
    assert sm.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=1_000)) is None
    task_id = sm.add()
    live = sm.add()
    sm.tick(500)
    sm.cancel(task_id)
    sm.tick(999)
    assert sm.state(task_id) == "cancelled"
    sm.tick(1)
    assert task_id not in sm.m.tasks
    assert sm.state(live) == "waiting"
    assert sm.m.tenant_counts_view("t")["cancelled"] == 0
    assert code(sm.cancel(task_id)) == ErrorCode.NOT_FOUND


def test_default_retention_is_a_day_and_lowering_it_purges_old_tasks(sm: Machine) -> None:
    task_id = sm.add()
    sm.cancel(task_id)
    sm.tick(3_600_000)
    assert sm.state(task_id) == "cancelled"
    sm.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=60_000))
    sm.tick(0)  # overdue purge timers fire at the next entry
    assert task_id not in sm.m.tasks


def test_raising_the_retention_keeps_tasks_longer(sm: Machine) -> None:
    sm.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=1_000))
    task_id = sm.add()
    sm.cancel(task_id)
    sm.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=10_000))
    sm.tick(5_000)
    assert sm.state(task_id) == "cancelled"
    sm.tick(5_000)
    assert task_id not in sm.m.tasks


@pytest.mark.parametrize("retention", [None, 0, -5])
def test_set_config_ignores_unset_or_non_positive_retention(
    sm: Machine, retention: int | None
) -> None:
    sm.apply(e.SetConfig(time_ms=sm.now, finished_task_retention_ms=retention))
    assert sm.m.config.finished_task_retention_ms == 24 * 3600 * 1000


# --- digest, snapshots -----------------------------------------------------------------------


def _scenario(sm: Machine, last_tenant: str = "t") -> None:
    sm.register()
    for i in range(6):
        sm.add(tenant="t" if i % 2 else "u", max_attempts=2, slot=f"s{i}")
    sm.assign(1)
    sm.assign(2)
    sm.finish(sm.outcome(1, ok=False))
    sm.add(tenant=last_tenant, start_after_ms=sm.now + 1_000)


def test_digest_equal_for_equal_histories_and_different_otherwise() -> None:
    a, b, c = Machine(), Machine(), Machine()
    _scenario(a)
    _scenario(b)
    _scenario(c, last_tenant="v")
    assert a.m.digest() == b.m.digest()
    assert a.m.digest() != c.m.digest()
    b.tick(1)  # time alone is state
    assert a.m.digest() != b.m.digest()
    assert len(a.m.digest()) == 64


def test_digest_does_not_depend_on_how_the_entry_object_was_built() -> None:
    # The leader applies the entry it built (ints here); followers apply it decoded (floats).
    leader, follower = Machine(), Machine()
    entries: list[e.Entry] = [
        e.SubmitTasks(
            time_ms=T0, tasks=(e.TaskSpec(id=1, type="py", tenant="t", resources={"cpu": 2}),)
        ),
        e.SetTenant(time_ms=T0, tenant="t", limits=e.TenantLimitsPatch(weight=2)),
        e.RegisterWorker(time_ms=T0, worker_id="w", resources={"cpu": 8}),
        e.SetConfig(time_ms=T0, global_limits={"licence": 2}),
    ]
    for entry in entries:
        leader.apply(entry)
        follower.apply(e.decode_entry(e.encode_entry(entry)))
    assert leader.m.digest() == follower.m.digest()


def test_snapshot_round_trip_preserves_state_and_waiting_order(sm: Machine) -> None:
    sm.register()
    ids = [sm.add(max_attempts=3) for _ in range(4)]
    for task_id in ids[:2]:
        sm.assign(task_id)
        sm.finish(sm.outcome(task_id, ok=False))  # retried: back of the queue
    assert sm.waiting() == [ids[2], ids[3], ids[0], ids[1]]
    sm.add(start_after_ms=sm.now + 500, deadline_ms=sm.now + 10_000, slot="s")
    txn = sm.begin(ttl_ms=2_000)
    sm.add(transaction=txn)
    data = sm.m.encode_snapshot()
    loaded = Machine(StateMachine.from_snapshot(data))
    loaded.m.check_invariants()
    assert loaded.m.encode_snapshot() == data
    assert loaded.m.digest() == sm.m.digest()
    assert loaded.waiting() == sm.waiting()
    assert loaded.m.count_by_state() == sm.m.count_by_state()
    assert loaded.m.slots == sm.m.slots
    assert loaded.m.running_by_worker.get("w1", set()) == set()
    # Timers were rebuilt: the delayed task starts, the transaction expires, on both.
    for machine in (sm, loaded):
        machine.tick(5_000)
        assert machine.m.count_by_state()["pending"] == 0
        assert machine.waiting()[-1] == 5
    assert loaded.m.digest() == sm.m.digest()


def test_snapshot_digest_stable_when_a_tenant_queue_empties_and_refills(sm: Machine) -> None:
    sm.register()
    a = sm.add("a")
    sm.add("b")
    sm.assign(a)  # a's queue is empty now, b's is not
    loaded = Machine(StateMachine.from_snapshot(sm.m.encode_snapshot()))
    for machine in (sm, loaded):
        machine.add("a")
    assert loaded.m.digest() == sm.m.digest()


def test_snapshot_of_an_unknown_body_version_is_refused(sm: Machine) -> None:
    body = sm.m.snapshot_body()
    body.format_version = 99
    with pytest.raises(ValueError, match="snapshot body format version 99 is newer"):
        StateMachine.from_snapshot(msgspec.msgpack.encode(body))


# --- entries -------------------------------------------------------------------------------------


ALL_ENTRIES: Final[list[e.Entry]] = [
    e.SubmitTasks(
        time_ms=1,
        tasks=(
            e.TaskSpec(
                id=1,
                type="py",
                tenant="t",
                params=b'{"a": [1, 2]}',
                slot="s",
                max_attempts=3,
                deadline_ms=10,
                start_after_ms=5,
                resources={"cpu": 1.5},
                transaction=7,
                code="ab" * 32,
            ),
        ),
    ),
    e.CancelTask(time_ms=2, task_id=1, reason="r"),
    e.BeginTransaction(time_ms=3, transaction_id=7, tenant="t", ttl_ms=5),
    e.CommitTransaction(time_ms=4, transaction_id=7),
    e.RollbackTransaction(time_ms=5, transaction_id=7),
    e.SetTenant(time_ms=6, tenant="t", limits=e.TenantLimitsPatch(max_waiting=1, weight=0.5)),
    e.SetConfig(time_ms=7, finished_task_retention_ms=100, global_limits={"licence": 2.0}),
    e.Tick(time_ms=8),
    e.RegisterWorker(
        time_ms=9,
        worker_id="w",
        address="a:1",
        resources={"cpu": 4.0},
        task_types={"*": 2},
        running=(e.TaskAttempt(1, 1),),
    ),
    e.WorkerDead(time_ms=10, worker_id="w", reason="gone"),
    e.AssignTasks(time_ms=11, assignments=(e.Assignment(1, "w"),)),
    e.FinishTasks(
        time_ms=12,
        outcomes=(e.TaskOutcome(task_id=1, worker_id="w", attempt=1, ok=False, error="x"),),
    ),
    e.AddCode(time_ms=13, sha256="ab" * 32, name="job.zip", size_bytes=3),
]


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=lambda entry: type(entry).__name__)
def test_every_entry_type_round_trips(entry: e.Entry) -> None:
    data = e.encode_entry(entry)
    assert e.decode_entry(data) == entry
    assert msgspec.msgpack.decode(data)["type"]  # a msgpack map with a type tag


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"garbage bytes",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "no_such_entry", "time_ms": 1}),
        msgspec.msgpack.encode({"time_ms": 1}),  # no type tag
        msgspec.msgpack.encode({"type": "tick"}),  # no time
        msgspec.msgpack.encode({"type": "cancel", "time_ms": 1, "task_id": "one"}),
        msgspec.msgpack.encode({"type": "tick", "time_ms": 1, "v": e.ENTRY_FORMAT_VERSION + 1}),
        msgspec.msgpack.encode({"type": "tick", "time_ms": 1, "v": e.ENTRY_FORMAT_VERSION + 10}),
    ],
)
def test_bad_entries_raise_entry_decode_error(data: bytes) -> None:
    with pytest.raises(e.EntryDecodeError):
        e.decode_entry(data)


def test_newer_entry_version_names_the_upgrade() -> None:
    data = msgspec.msgpack.encode({"type": "tick", "time_ms": 1, "v": e.ENTRY_FORMAT_VERSION + 1})
    with pytest.raises(e.EntryDecodeError, match="upgrade the broker"):
        e.decode_entry(data)


def test_current_version_is_omitted_and_accepted() -> None:
    data = e.encode_entry(e.Tick(time_ms=1))
    assert "v" not in msgspec.msgpack.decode(data)
    explicit = msgspec.msgpack.encode(
        {"type": "tick", "time_ms": 1, "v": e.BASE_ENTRY_FORMAT_VERSION}
    )
    assert e.decode_entry(explicit) == e.Tick(time_ms=1)
    newest = msgspec.msgpack.encode({"type": "tick", "time_ms": 1, "v": e.ENTRY_FORMAT_VERSION})
    assert e.decode_entry(newest) == e.Tick(time_ms=1, v=e.ENTRY_FORMAT_VERSION)


@pytest.mark.parametrize(
    ("tenant", "task_type"), [("acme\n", "noop"), ("acme", "noop\n"), ("acme\n", "noop\n")]
)
def test_names_with_a_final_newline_are_refused(tenant: str, task_type: str) -> None:
    spec = e.TaskSpec(id=1, type=task_type, tenant=tenant)
    assert validate_task_spec(spec) is not None
    machine = StateMachine()
    results = machine.apply(e.SubmitTasks(time_ms=1, tasks=(spec,))).result
    assert isinstance(results, list) and isinstance(results[0], Rejected)
    assert machine.tasks == {}
