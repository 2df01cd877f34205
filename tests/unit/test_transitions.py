"""The table of legal task transitions (broker/core/transitions.py).

- Every edge of the table is reachable: small hand-built scenarios drive a recording
  StateMachine through each one, in an entry of a type the edge allows (the simulation
  test, tests/sim/test_simulation.py, checks its random streams against the same table
  and that they exercise every edge too).
- An illegal move planted with ``move`` raises an AssertionError naming it.
- The state diagram in docs/DESIGN.md ("Task states") has exactly the table's edges.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import pytest

from broker.core import Applied, StateMachine, Task, TaskState
from broker.core import entries as e
from broker.core.transitions import EDGES, TRANSITIONS, check_move
from tests.support.machine import Trees

DESIGN: Final = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"

Move = tuple[str | None, str | None]


class Recorder(StateMachine):
    """A StateMachine recording each task transition with the type of the entry applying."""

    def __init__(self) -> None:
        super().__init__()
        self.entry: type[e.Entry] | None = None
        self.moves: list[tuple[Move, type[e.Entry] | None]] = []

    def apply(self, entry: e.Entry) -> Applied:
        self.entry = type(entry)
        try:
            return super().apply(entry)
        finally:
            self.entry = None

    def add_task(self, task: Task) -> None:
        self.moves.append(((None, str(task.state)), self.entry))
        super().add_task(task)

    def move(self, task: Task, new: TaskState) -> None:
        old = str(task.state)
        super().move(task, new)
        if old != str(new):
            self.moves.append(((old, str(new)), self.entry))

    def delete_task(self, task: Task) -> None:
        self.moves.append(((str(task.state), None), self.entry))
        super().delete_task(task)


def _machine() -> tuple[Trees, Recorder]:
    recorder = Recorder()
    m = Trees(recorder)
    assert m.apply(e.SetConfig(time_ms=m.now, finished_task_retention_ms=1_000)) is None
    return m, recorder


def _lifecycle() -> Recorder:
    """Submit, commit, start, assign, finish, fail, retry, purge: the common paths."""
    m, r = _machine()
    txn = m.begin()
    now_later = m.now + 5_000
    waits = m.add(transaction=txn)  # None -> pending
    delays = m.add(transaction=txn, start_after_ms=now_later)
    m.apply(e.CommitTransaction(time_ms=m.now, transaction_id=txn, tenant="t"))
    assert m.state(waits) == "waiting" and m.state(delays) == "delayed"
    txn = m.begin()
    m.add(transaction=txn)
    m.apply(e.RollbackTransaction(time_ms=m.now, transaction_id=txn, tenant="t"))  # -> None
    later = m.add(start_after_ms=m.now + 1_000)  # None -> delayed
    m.tick(1_000)
    assert m.state(later) == "waiting"
    m.done(waits)  # waiting -> running -> finished
    retried = m.add(max_attempts=1, max_lost=1)
    m.run(retried)
    m.worker_dead()  # running -> waiting (lost with its worker: not counted)
    assert m.state(retried) == "waiting"
    m.register()
    m.fail(retried)  # running -> error (its last attempt)
    assert m.state(retried) == "error"
    lost_twice = m.add(max_attempts=5, max_lost=1)
    for _ in range(2):
        m.register()
        m.run(lost_twice)
        m.worker_dead()  # running -> waiting, then -> error (lost more than max_lost times)
    assert m.state(lost_twice) == "error"
    m.tick(10_000)  # purge: finished, error -> None
    assert waits not in m.m.tasks and retried not in m.m.tasks and lost_twice not in m.m.tasks
    return r


def _cancels_and_deadlines() -> Recorder:
    """Cancel and deadline from each live state; purge of a cancelled task."""
    m, r = _machine()
    for end in ("cancel", "deadline"):
        deadline = m.now + 1_000 if end == "deadline" else None
        txn = m.begin(ttl_ms=60_000)
        pending = m.add(transaction=txn, deadline_ms=deadline)
        delayed = m.add(start_after_ms=m.now + 50_000, deadline_ms=deadline)
        waiting = m.add(deadline_ms=deadline)
        running = m.add(deadline_ms=deadline)
        m.run(running)
        assert [m.state(t) for t in (pending, delayed, waiting, running)] == [
            "pending",
            "delayed",
            "waiting",
            "running",
        ]
        ids = (pending, delayed, waiting, running)
        if end == "cancel":
            for task_id in ids:
                m.cancel(task_id)
            assert {m.state(t) for t in ids} == {"cancelled"}
        else:
            m.tick(1_000)
            assert {m.state(t) for t in ids} == {"error"}
        m.apply(e.RollbackTransaction(time_ms=m.now, transaction_id=txn, tenant="t"))
    m.tick(10_000)  # purge: cancelled -> None
    txn = m.begin(ttl_ms=1_000)
    expires = m.add(transaction=txn)
    m.tick(1_000)  # the transaction expires: pending -> None
    assert expires not in m.m.tasks
    return r


def _trees() -> Recorder:
    """Spawned children, a tree's failure cancelling pending ones, roots replayed."""
    m, r = _machine()
    root = m.root(max_attempts=3)
    first = m.child(root)
    later = m.child(root, start_after_ms=m.now + 50_000)
    (a, _) = m.done(root, first, later)  # None -> waiting / delayed in FinishTasks
    m.fail(a)  # the tree fails: the delayed child cancelled, the finished root replayed
    assert m.state(root) == "waiting" and m.state(later.task.id) == "cancelled"
    m.run(root)
    m.tick(30_000)  # the tree times out with its root running: running -> waiting
    assert m.state(root) == "waiting" and m.tree(root).attempt == 3
    return r


def _backoff() -> Recorder:
    """A failed attempt with a retry backoff waits delayed until its retry is due."""
    m, r = _machine()
    backs_off = m.add(max_attempts=2, retry_backoff_ms=1_000)
    m.fail(backs_off)  # running -> delayed
    assert m.state(backs_off) == "delayed"
    m.tick(1_250)  # at most +25%: delayed -> waiting
    assert m.state(backs_off) == "waiting"
    return r


SCENARIOS: Final = (_lifecycle, _cancels_and_deadlines, _trees, _backoff)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.strip("_"))
def test_scenario_moves_are_legal_in_their_entries(scenario: object) -> None:
    assert callable(scenario)
    recorder = scenario()
    assert recorder.moves
    for move, entry in recorder.moves:
        assert move in EDGES, move
        allowed = EDGES[move].entries  # type: ignore[index]
        assert allowed is None or entry in allowed, (move, entry)


def test_every_edge_of_the_table_is_reachable() -> None:
    seen = {move for scenario in SCENARIOS for move, _ in scenario().moves}
    missing = [f"{old} -> {new}" for old, new in EDGES if (old, new) not in seen]
    assert not missing, f"edges no scenario reaches: {missing}"


def test_the_table_is_consistent() -> None:
    states: set[TaskState | None] = {None, *TaskState}
    assert set(TRANSITIONS) == states  # every state has a row (None: not created yet)
    for old, targets in TRANSITIONS.items():
        assert old not in targets, f"{old} -> {old} is not a move"
        assert set(targets) <= states
        for edge in targets.values():
            assert edge.reason
    assert not TRANSITIONS[None].get(None), "created then deleted is two moves"
    # Final states only leave by a purge or (finished) a replay.
    assert set(TRANSITIONS[TaskState.ERROR]) == {None}
    assert set(TRANSITIONS[TaskState.CANCELLED]) == {None}


@pytest.mark.parametrize(
    "old, new",
    [
        ("finished", "running"),
        ("cancelled", "waiting"),
        ("waiting", "finished"),
        ("error", "waiting"),
        ("delayed", "running"),
        (None, "running"),
    ],
)
def test_check_move_names_an_illegal_move(old: str | None, new: str | None) -> None:
    with pytest.raises(AssertionError, match=f"illegal task state transition {old} -> {new}"):
        check_move(old, new)


def test_check_move_allows_every_edge() -> None:
    for old, new in EDGES:
        check_move(old, new)
        check_move(None if old is None else str(old), None if new is None else str(new))


def test_planted_illegal_moves_raise_and_change_nothing() -> None:
    m, _ = _machine()
    task_id = m.add()
    m.done(task_id)
    machine = m.m
    task = machine.tasks[task_id]
    with pytest.raises(AssertionError, match="illegal task state transition finished -> running"):
        machine.move(task, TaskState.RUNNING)
    assert task.state == "finished" and task_id in machine.by_state[TaskState.FINISHED]
    machine.check_invariants()
    waiting = machine.tasks[m.add()]
    with pytest.raises(AssertionError, match="waiting -> finished"):
        machine.move(waiting, TaskState.FINISHED)
    machine.check_invariants()
    machine.move(waiting, TaskState.WAITING)  # no change is no move
    with pytest.raises(AssertionError, match="illegal task state transition waiting -> None"):
        machine.delete_task(waiting)
    assert waiting.id in machine.tasks
    machine.check_invariants()


_DIAGRAM_EDGE: Final = re.compile(r"^\s*(\[\*\]|\w+)\s*-->\s*(\[\*\]|\w+)\s*:\s*(.+?)\s*$")


def _diagram_edges() -> list[tuple[str | None, str | None, str]]:
    """The docs' state diagram: (old, new, label) per edge line, ``[*]`` read as None."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## Task states", 1)[1]
    block = section.split("```mermaid", 1)[1].split("```", 1)[0]
    edges: list[tuple[str | None, str | None, str]] = []
    for line in block.splitlines():
        if "-->" not in line:
            continue
        match = _DIAGRAM_EDGE.match(line)
        assert match, f"unreadable diagram line: {line!r}"
        old, new, label = match.groups()
        edges.append((None if old == "[*]" else old, None if new == "[*]" else new, label))
    return edges


def test_design_state_diagram_is_the_table() -> None:
    edges = _diagram_edges()
    assert len(edges) == len({(old, new) for old, new, _ in edges}), "an edge drawn twice"
    table = {(old, new, edge.reason) for (old, new), edge in EDGES.items()}
    assert set(edges) == table
