"""Task priorities within a tenant and retry backoff (docs/DESIGN.md §6, "Priorities and
backoff"), on the state machine and the scheduler driven with real entries."""

from __future__ import annotations

import msgspec
import pytest

from broker.core import ErrorCode, Rejected, StateMachine, Task
from broker.core import entries as e
from broker.core.backoff import MAX_BACKOFF_MS, MAX_PRIORITY, retry_delay_ms
from broker.core.scheduler import schedule
from tests.support.machine import Machine, Trees, code


def _cluster(capacity: int = 1) -> Trees:
    m = Trees()
    entry = e.RegisterWorker(time_ms=m.now, worker_id="w1", task_types={"*": capacity})
    m.apply(entry)
    return m


def _round(m: Trees) -> list[int]:
    """One scheduling round, logged and applied; the ids it started, in order."""
    assignments = schedule(m.m)
    if assignments:
        m.apply(e.AssignTasks(time_ms=m.now, assignments=tuple(assignments)))
    return [a.task_id for a in assignments]


def _finish_all(m: Trees, ids: list[int]) -> None:
    m.finish(*(m.outcome(i) for i in ids))


def test_higher_priority_first_fifo_within_a_priority() -> None:
    m = _cluster(capacity=1)
    low = [m.add(), m.add()]
    high = [m.add(priority=5), m.add(priority=5)]
    mid = m.add(priority=1)
    below = m.add(priority=-3)
    order: list[int] = []
    for _ in range(6):
        started = _round(m)
        order += started
        _finish_all(m, started)
    assert order == [*high, mid, *low, below]


def test_a_retried_task_rejoins_the_end_of_its_priority() -> None:
    m = _cluster(capacity=1)
    first = m.add(priority=2, max_attempts=2)
    second = m.add(priority=2)
    low = m.add()
    assert _round(m) == [first]
    m.fail(first)  # attempt left, no backoff: waits again behind ``second``
    assert m.m.queue_head("t") == second
    order: list[int] = []
    for _ in range(3):
        started = _round(m)
        order += started
        _finish_all(m, started)
    assert order == [second, first, low]


def test_fairness_between_tenants_ignores_priorities() -> None:
    m = _cluster(capacity=4)
    urgent = [m.add("a", priority=100) for _ in range(4)]
    plain = [m.add("b") for _ in range(4)]
    started = _round(m)
    # Equal weights: two each, whatever a's priorities (they order a's queue only).
    assert sorted(started) == sorted(urgent[:2] + plain[:2])


def test_priority_order_survives_a_snapshot_round_trip() -> None:
    m = _cluster(capacity=1)
    ids = [m.add(priority=p, max_attempts=3) for p in (0, 3, 3, 1, 0, 3)]
    started = _round(m)
    m.fail(started[0])  # re-queued: the queue order now differs from id order
    copy = StateMachine.from_snapshot(m.m.encode_snapshot())
    copy.check_invariants()
    assert copy.digest() == m.m.digest()
    assert copy.by_priority == m.m.by_priority
    assert schedule(copy) == schedule(m.m)
    assert list(copy.by_priority["t"][3]) == [ids[2], ids[5], ids[1]]


def test_assignment_reads_only_the_window_whatever_the_lower_levels_hold() -> None:
    m = _cluster(capacity=5)
    m.submit(*(m.spec(priority=0) for _ in range(5_000)))
    high = [m.add(priority=9) for _ in range(5)]

    class CountingTasks(dict[int, Task]):
        reads = 0

        def __getitem__(self, key: int) -> Task:
            CountingTasks.reads += 1
            return super().__getitem__(key)

    m.m.tasks = CountingTasks(m.m.tasks)
    assert [a.task_id for a in schedule(m.m)] == high
    assert CountingTasks.reads <= 5


@pytest.mark.parametrize("task_id", [1, 2, 77, 123_456])
def test_retry_delay_doubles_is_capped_and_jitters_within_a_quarter(task_id: int) -> None:
    base, cap = 1_000, 10_000
    for retry in range(1, 12):
        nominal = min(base * 2 ** (retry - 1), cap)
        delay = retry_delay_ms(task_id, retry, base, cap)
        assert nominal * 0.75 <= delay <= nominal * 1.25
        assert delay == retry_delay_ms(task_id, retry, base, cap)  # deterministic
    assert retry_delay_ms(task_id, 1, 0, cap) == 0
    assert retry_delay_ms(task_id, 10_000, 1, MAX_BACKOFF_MS) <= MAX_BACKOFF_MS * 1.25


def test_jitter_spreads_tasks_failing_together() -> None:
    delays = {retry_delay_ms(task_id, 1, 10_000, 60_000) for task_id in range(1, 200)}
    assert len(delays) > 100
    assert min(delays) < 8_000 and max(delays) > 12_000


def test_a_failed_attempt_waits_delayed_until_its_retry_is_due() -> None:
    m = _cluster()
    task_id = m.add(max_attempts=3, retry_backoff_ms=2_000, retry_backoff_max_ms=3_000)
    for retry in (1, 2):
        assert _round(m) == [task_id]
        failed_at = m.now
        m.fail(task_id)
        task = m.m.tasks[task_id]
        assert task.state == "delayed" and task.error == "boom"
        due = failed_at + retry_delay_ms(task_id, retry, 2_000, 3_000)
        assert task.start_after_ms == due
        assert _round(m) == []  # not before it is due
        # The due time is in the state: a replica built from a snapshot fires it too.
        copy = Machine(StateMachine.from_snapshot(m.m.encode_snapshot()))
        m.tick(due - m.now - 1)
        assert m.state(task_id) == "delayed"
        m.tick(1)
        copy.tick(due - copy.now)
        assert m.state(task_id) == copy.state(task_id) == "waiting"
        assert m.m.digest() == copy.m.digest()
    assert _round(m) == [task_id]
    m.fail(task_id)  # the last attempt: no backoff, it ends
    assert m.state(task_id) == "error"


def test_a_given_back_attempt_is_not_delayed() -> None:
    m = _cluster()
    task_id = m.add(max_attempts=2, retry_backoff_ms=60_000)
    _round(m)
    given_back = msgspec.structs.replace(m.outcome(task_id, ok=False), released=True)
    m.finish(given_back)
    assert m.state(task_id) == "waiting"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"priority": MAX_PRIORITY + 1}, "priority must be between"),
        ({"priority": -MAX_PRIORITY - 1}, "priority must be between"),
        ({"retry_backoff_ms": -1}, "retry_backoff_s must be between"),
        ({"retry_backoff_ms": MAX_BACKOFF_MS + 1}, "retry_backoff_s must be between"),
        ({"retry_backoff_max_ms": -5}, "retry_backoff_max_s must be between"),
    ],
)
def test_bad_scheduling_fields_are_rejected(fields: dict[str, int], message: str) -> None:
    m = Trees()
    result = m.submit_one("t", **fields)
    assert code(result) is ErrorCode.INVALID
    assert isinstance(result, Rejected) and message in result.message


def test_entries_with_the_new_fields_are_written_as_version_3() -> None:
    plain = e.TaskSpec(id=1, type="py", tenant="t")
    assert e.submit_version((plain,)) == e.BASE_ENTRY_FORMAT_VERSION
    assert e.submit_version((plain, e.TaskSpec(id=2, type="py", tenant="t", priority=1))) == 3
    assert e.submit_version((e.TaskSpec(id=3, type="py", tenant="t", retry_backoff_ms=5),)) == 3
    assert e.ENTRY_FORMAT_VERSION >= 3
