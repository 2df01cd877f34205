"""The soak's checks find what they look for (fast: hand-made records, no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.chaos.soak_checks import (
    Claim,
    check_counted,
    check_effects,
    check_final_states,
    check_outages,
    check_split_brain,
    check_tasks,
    check_transactions,
    check_trees,
    check_zombies,
    count_log_events,
    drain_bound_s,
    measure_outages,
    stuck_tasks,
    zombie_overlaps,
)
from tests.chaos.soak_parts import TASK_TYPE, TENANT, Acked, ChaosLoad, SoakConfig


def _load(tmp_path: Path, keys: dict[str, int]) -> ChaosLoad:
    load = ChaosLoad(
        ["http://127.0.0.1:1"],
        seed=1,
        code_sha="0" * 64,
        effects_path=tmp_path / "effects.jsonl",
        config=SoakConfig(seed=1),
    )
    for key, task_id in keys.items():
        params = _params(key)
        load.attempted[key] = params
        load.acked[key] = Acked(key, task_id, params, 0.0)
    return load


def _params(key: str) -> dict[str, Any]:
    return {"key": key, "seconds": 0.1, "effects": "/x"}


def _task(task_id: int, key: str, state: str = "finished", attempt: int = 1) -> dict[str, Any]:
    result = {"task": task_id, "attempt": attempt, "key": key} if state == "finished" else None
    return {
        "id": task_id,
        "type": TASK_TYPE,
        "tenant": TENANT,
        "params": _params(key),
        "state": state,
        "attempt": attempt,
        "result": result,
    }


def _runs(task_id: int, *attempts: int, done: bool = True) -> list[dict[str, Any]]:
    records = []
    for attempt in attempts:
        records.append({"event": "start", "task": task_id, "attempt": attempt, "pid": 1})
    if done:
        records.append({"event": "done", "task": task_id, "attempt": attempts[-1], "pid": 1})
    return records


def test_a_clean_run_has_no_problems(tmp_path: Path) -> None:
    load = _load(tmp_path, {"a": 1, "b": 2})
    tasks = {1: _task(1, "a"), 2: _task(2, "b", attempt=2)}
    assert check_tasks(load.acked, load.attempted, tasks) == []
    # Task 2's first attempt died with its worker (a start, no done), the second finished.
    assert check_effects(tasks, _runs(1, 1) + _runs(2, 1, 2)) == []


def test_lost_changed_duplicated_and_unsent_tasks_are_found(tmp_path: Path) -> None:
    load = _load(tmp_path, {"a": 1, "b": 2, "c": 3})
    changed = _task(2, "b")
    changed["params"] = {**changed["params"], "seconds": 9}
    tasks = {2: changed, 3: _task(3, "c"), 4: _task(4, "c"), 5: _task(5, "never")}
    problems = "\n".join(check_tasks(load.acked, load.attempted, tasks))
    assert "acknowledged task 1 (a) is lost" in problems
    assert "task 2 is" in problems and "was submitted as" in problems
    assert "submission c became 2 tasks" in problems
    assert "task 5" in problems and "was never submitted" in problems


def test_a_result_of_an_older_attempt_is_found(tmp_path: Path) -> None:
    load = _load(tmp_path, {"a": 1})
    task = _task(1, "a", attempt=2)
    task["result"] = {"task": 1, "attempt": 1, "key": "a"}
    assert check_tasks(load.acked, load.attempted, {1: task}) != []


def test_double_runs_and_unknown_attempts_are_found(tmp_path: Path) -> None:
    tasks = {1: _task(1, "a"), 2: _task(2, "b"), 3: _task(3, "c")}
    effects = _runs(1, 1) + _runs(1, 1) + _runs(2, 1, 2) + _runs(3, 1, done=False)
    problems = "\n".join(check_effects(tasks, effects))
    assert "task 1 attempt 1 has 2 'start' records (ran twice)" in problems
    assert "task 2 ran attempt 2 but the broker shows attempt 1" in problems
    assert "task 3 finished with attempt 1 but no run of it completed" in problems


def test_an_acknowledged_task_that_did_not_finish_is_found() -> None:
    tasks = {
        1: _task(1, "a", state="error"),
        2: _task(2, "b", state="cancelled"),
        3: _task(3, "c", state="cancelled"),
        4: _task(4, "d"),
    }
    problems = "\n".join(check_final_states({1: "a", 2: "b", 3: "c", 4: "d"}, tasks, [3]))
    assert "task 1 (a) ended 'error'" in problems
    assert "task 2 (b) ended 'cancelled'" in problems  # nobody asked to cancel it
    assert "task 3" not in problems and "task 4" not in problems


def test_the_drain_bound_grows_with_the_backlog_and_stuck_tasks_are_named() -> None:
    assert drain_bound_s(0, 5.0, floor_s=60) == 60
    assert drain_bound_s(3000, 10.0, floor_s=60) == 900
    tasks = {1: _task(1, "a"), 2: {**_task(2, "b", state="running"), "worker": "w1"}}
    assert stuck_tasks([1, 2], tasks) == {2: "running attempt 1 on w1"}


def test_a_stale_report_that_won_is_found() -> None:
    effects = [
        {"event": "start", "task": 1, "attempt": 1},
        {"event": "start", "task": 1, "attempt": 2},
        {"event": "done", "task": 1, "attempt": 1},
        {"event": "end", "task": 1, "attempt": 1},
        {"event": "done", "task": 1, "attempt": 2},
        {"event": "end", "task": 1, "attempt": 2},
        # No overlap: attempt 1 ended before attempt 2 started.
        {"event": "start", "task": 2, "attempt": 1},
        {"event": "end", "task": 2, "attempt": 1},
        {"event": "start", "task": 2, "attempt": 2},
    ]
    overlaps = zombie_overlaps(effects)
    assert overlaps == [(1, 1, 2)]
    good = _task(1, "a", attempt=2)
    assert check_zombies(overlaps, {1: good}) == []
    stale = {**good, "result": {"task": 1, "attempt": 1, "key": "a"}}
    assert "stale attempt 1's report won" in check_zombies(overlaps, {1: stale})[0]
    back = _task(1, "a", attempt=1)
    assert "ended 'finished' at attempt 1" in check_zombies(overlaps, {1: back})[0]


def test_two_live_leaders_are_found() -> None:
    newer_first = [Claim(1.0, "b", 7), Claim(1.2, "a", 5)]  # a still leads after b took over
    older_first = [Claim(1.0, "a", 5), Claim(1.2, "b", 7)]  # a may have stepped down since
    one_ledger = [Claim(1.0, "a", 5), Claim(1.1, "b", 5)]
    problems, ambiguous = check_split_brain([newer_first, older_first, one_ledger, []])
    assert ambiguous == 1
    assert len(problems) == 2
    assert "split brain: a (ledger 5)" in problems[0]
    assert "two brokers lead on one ledger" in problems[1]


def test_an_over_long_outage_is_found() -> None:
    outages = measure_outages(
        [("kill_broker", 10.0, True), ("stop_broker", 20.0, True), ("kill_broker", 30.0, True)],
        acks=[5.0, 21.0, 35.0, 50.0],
        others=[40.0],
    )
    assert [o.seconds for o in outages] == [11.0, 1.0, 5.0]
    problems = check_outages(outages, bound_s=10.0)
    assert len(problems) == 1 and "kill_broker at +10.00" in problems[0]
    # Another broker down before the next ack: not this fault's outage alone.
    mixed = measure_outages([("kill_broker", 10.0, True)], acks=[25.0], others=[12.0])
    assert not mixed[0].clean and check_outages(mixed, bound_s=10.0) == []
    never = measure_outages([("kill_broker", 10.0, True)], acks=[5.0], others=[])
    assert "no acknowledged write for ever" in check_outages(never, bound_s=10.0)[0]


def test_rolls_retention_and_downloads_are_counted(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    log.write_text(
        "x rolled from ledger 3 to 4\nx retention deleted ledgers [1, 2]\n"
        "x rolled from ledger 4 to 5\n"
    )
    counts = count_log_events([log, tmp_path / "missing.log"])
    assert counts["ledger_rolls"] == 2 and counts["retention_deletes"] == 1
    assert check_counted(counts, ["ledger_rolls", "snapshot_downloads"]) == [
        "no snapshot downloads in this run"
    ]


def test_a_tree_root_that_lost_a_child_is_found(tmp_path: Path) -> None:
    load = _load(tmp_path, {"r": 1, "s": 4})
    for key in ("r", "s"):
        ack = load.acked[key]
        load.acked[key] = Acked(key, ack.task_id, {**ack.params, "children": 2}, 0.0)
    tasks = {
        1: _task(1, "r"),
        2: _task(2, "r-a1-c0"),
        3: _task(3, "r-a1-c1", state="error"),
        4: _task(4, "s"),
        5: _task(5, "s-a1-c0"),
        6: _task(6, "s-a0-c1"),  # of an earlier attempt: not this one's
    }
    problems = "\n".join(check_trees(load.acked, tasks, cancelled=[]))
    assert "child 3 of tree root 1 ended 'error'" in problems
    assert "tree root 4 (s) finished without child 1" in problems
    # Children are known to the task check: their keys name the root's.
    assert "never submitted" not in "\n".join(check_tasks(load.acked, load.attempted, tasks))


def test_a_transaction_half_there_is_found() -> None:
    tasks = {1: _task(1, "t-b0"), 2: _task(2, "u-b0"), 3: _task(3, "u-b1")}
    problems = check_transactions([["t-b0", "t-b1"], ["u-b0", "u-b1"], ["v-b0", "v-b1"]], tasks)
    assert problems == ["transaction of ['t-b0', 't-b1'] is partly there: ['t-b0']"]
