"""The soak's checks find what they look for (fast: hand-made records, no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.chaos.soak import ChaosSoak
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
    assert ChaosSoak._check_tasks(load, tasks) == []
    # Task 2's first attempt died with its worker (a start, no done), the second finished.
    assert ChaosSoak._check_effects(tasks, _runs(1, 1) + _runs(2, 1, 2)) == []


def test_lost_changed_duplicated_and_unsent_tasks_are_found(tmp_path: Path) -> None:
    load = _load(tmp_path, {"a": 1, "b": 2, "c": 3})
    changed = _task(2, "b")
    changed["params"] = {**changed["params"], "seconds": 9}
    tasks = {2: changed, 3: _task(3, "c"), 4: _task(4, "c"), 5: _task(5, "never")}
    problems = "\n".join(ChaosSoak._check_tasks(load, tasks))
    assert "acknowledged task 1 (a) is lost" in problems
    assert "task 2 is" in problems and "was submitted as" in problems
    assert "submission c became 2 tasks" in problems
    assert "task 5" in problems and "was never submitted" in problems


def test_a_result_of_an_older_attempt_is_found(tmp_path: Path) -> None:
    load = _load(tmp_path, {"a": 1})
    task = _task(1, "a", attempt=2)
    task["result"] = {"task": 1, "attempt": 1, "key": "a"}
    assert ChaosSoak._check_tasks(load, {1: task}) != []


def test_double_runs_and_unknown_attempts_are_found(tmp_path: Path) -> None:
    tasks = {1: _task(1, "a"), 2: _task(2, "b"), 3: _task(3, "c")}
    effects = _runs(1, 1) + _runs(1, 1) + _runs(2, 1, 2) + _runs(3, 1, done=False)
    problems = "\n".join(ChaosSoak._check_effects(tasks, effects))
    assert "task 1 attempt 1 has 2 'start' records (ran twice)" in problems
    assert "task 2 ran attempt 2 but the broker shows attempt 1" in problems
    assert "task 3 finished with attempt 1 but no run of it completed" in problems
