"""The state machine as parts with owners (docs/DESIGN.md §2, "The state machine's parts").

- No class in broker/core has more than one base class of the project's own (ast): the
  state machine is composed of parts, not spread over mixins.
- Each index part has an invariant check ("equal to a rebuild", or what it must hold):
  after a seeded workload every check passes, and a corrupted part is caught, by its own
  check and by ``check_invariants``.
- broker/core/__init__.py exports the names other packages use, each from the module that
  defines it, and loads them on first use (a worker importing ``broker.core.entries`` does
  not load the state machine).
"""

from __future__ import annotations

import ast
import heapq
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import broker.core
from broker.core import InvariantError, Rejected, StateMachine, TaskState
from broker.core import entries as e
from tests.support.sim_generator import EntryGenerator
from tests.support.sim_model import TracedMachine

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "broker" / "core"
PROJECT_PACKAGES = ("broker", "log", "snapshot", "clients", "examples")


def _project_bases(path: Path) -> dict[str, list[str]]:
    """Each class of the module -> its base classes that are the project's own (imported
    from a project module, or defined in the module itself)."""
    tree = ast.parse(path.read_text(), str(path))
    own: set[str] = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level > 0 or (node.module or "").split(".")[0] in PROJECT_PACKAGES
        ):
            own.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            own.update(
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] in PROJECT_PACKAGES
            )
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = []
            for base in node.bases:
                root = base
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in own:
                    bases.append(ast.unparse(base))
            out[node.name] = bases
    return out


def test_no_class_in_core_has_more_than_one_base_of_the_projects_own() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: class {name}({', '.join(bases)})"
        for path in sorted(CORE.rglob("*.py"))
        for name, bases in _project_bases(path).items()
        if len(bases) > 1
    ]
    assert not offenders, "compose parts instead of mixing classes in:\n" + "\n".join(offenders)


def test_the_base_count_sees_a_mixin_class(tmp_path: Path) -> None:
    module = tmp_path / "mixed.py"
    module.write_text(
        "from broker.core.books import Books\nfrom broker.core import tasks\n"
        "class Local: ...\n"
        "class Mixed(Books, tasks.Something, Local, Exception): ...\n"
    )
    assert _project_bases(module)["Mixed"] == ["Books", "tasks.Something", "Local"]


def _worked_machine(seed: int = 1, entries: int = 2_501) -> StateMachine:
    """A state after a seeded stream of entries (the simulation's generator)."""
    machine = TracedMachine()
    generator = EntryGenerator(seed, machine)
    for _ in range(entries):
        entry, _ = generator.next()
        machine.apply(e.decode_entry(e.encode_entry(entry)))
    for index in range(2):  # the stream issues no API tokens
        token = e.CreateToken(
            time_ms=machine.now_ms,
            token_id=f"a{index}",
            name="ops",
            role="admin",
            sha256=f"{index}" * 64,
        )
        assert not isinstance(machine.apply(token).result, Rejected)
    machine.check_invariants()
    return machine


def _first(ids: object) -> int:
    assert isinstance(ids, (set, dict)) and ids, ids
    return min(ids)


# Each part: how to corrupt it, and what its own check returns then (None: it passed).
def _drop_a_queued_task(m: StateMachine) -> str | None:
    tenant = next(t for t, q in m.queues.waiting.items() if q)
    del m.queues.waiting[tenant][_first(m.queues.waiting[tenant])]
    return m.queues.check(m.tasks, m.code_blocked, lambda sha: None)


def _move_a_task_in_by_state(m: StateMachine) -> str | None:
    task_id = _first(m.states.by_state[TaskState.FINISHED])
    m.states.by_state[TaskState.FINISHED].discard(task_id)
    m.states.by_state[TaskState.ERROR].add(task_id)
    return m.states.check(m.tasks)


def _lose_a_running_task(m: StateMachine) -> str | None:
    worker = next(w for w, ids in m.running.by_worker.items() if ids)
    m.running.by_worker[worker].discard(_first(m.running.by_worker[worker]))
    return m.running.check(m.tasks)


def _take_a_free_slot(m: StateMachine) -> str | None:
    task = next(t for t in m.tasks.values() if t.state == TaskState.FINISHED)
    m.slot_index.holders[(task.tenant, "stolen")] = task.id
    return m.slot_index.check(m.tasks)


def _forget_a_tree_member(m: StateMachine) -> str | None:
    root = next(iter(m.tree_index.members))
    m.tree_index.members[root].discard(_first(m.tree_index.members[root]))
    return m.tree_index.check(m.tasks)


def _invent_a_dependant(m: StateMachine) -> str | None:
    task = next(iter(m.tasks.values()))
    m.dependant_index.waiting.setdefault(task.id, {})[task.id] = None
    return m.dependant_index.check(m.tasks)


def _lose_a_timer(m: StateMachine) -> str | None:
    wanted = m.timers_rebuilt().heap
    _, kind, ident = max(t for t in wanted if t[0] > m.now_ms)  # the last to fire
    m.timers.heap = [t for t in m.timers.heap if t[1:] != (kind, ident)]
    heapq.heapify(m.timers.heap)
    return m.timers.check(m.timers_rebuilt(), m.now_ms)


def _break_the_idempotency_order(m: StateMachine) -> str | None:
    records = m.idempotency_keys.records
    records.move_to_end(next(iter(records)))
    return m.idempotency_keys.check(m.now_ms)


def _forget_a_token_hash(m: StateMachine) -> str | None:
    m.token_index.ids_by_hash.popitem()
    return m.token_index.check()


CORRUPTIONS: dict[str, Callable[[StateMachine], str | None]] = {
    "TaskQueues": _drop_a_queued_task,
    "StateIndex": _move_a_task_in_by_state,
    "RunningIndex": _lose_a_running_task,
    "SlotIndex": _take_a_free_slot,
    "TreeIndex": _forget_a_tree_member,
    "DependantsIndex": _invent_a_dependant,
    "Timers": _lose_a_timer,
    "IdempotencyKeys": _break_the_idempotency_order,
    "TokenIndex": _forget_a_token_hash,
}


def test_every_index_part_has_a_corruption_case() -> None:
    tree = ast.parse((CORE / "indexes.py").read_text())
    parts = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and f.name == "check" for f in node.body)
    }
    assert parts == set(CORRUPTIONS)


@pytest.fixture(scope="module")
def snapshot() -> bytes:
    machine = _worked_machine()
    # The workload reaches every part: otherwise a corruption case below would test nothing.
    assert machine.queues.waiting_count and any(machine.running.by_worker.values())
    assert machine.tree_index.members and machine.idempotency_keys and machine.tokens
    assert machine.dependant_index.waiting and machine.states.by_state[TaskState.FINISHED]
    return machine.encode_snapshot()


@pytest.mark.parametrize("part", sorted(CORRUPTIONS))
def test_a_part_equals_its_rebuild_and_its_check_catches_a_corruption(
    part: str, snapshot: bytes
) -> None:
    machine = StateMachine.from_snapshot(snapshot)
    machine.check_invariants()  # each part's check passes on a loaded state
    problem = CORRUPTIONS[part](machine)
    assert problem is not None, f"{part}'s check missed the corruption"
    with pytest.raises(InvariantError):
        machine.check_invariants()


def test_the_capacity_index_check_catches_a_corruption(snapshot: bytes) -> None:
    machine = StateMachine.from_snapshot(snapshot)
    capacity = machine.capacity()
    machine.check_invariants()
    capacity.free_slots += 1
    with pytest.raises(InvariantError, match="capacity index differs from a rebuild"):
        machine.check_invariants()


def _type_checking_exports() -> dict[str, str]:
    tree = ast.parse((CORE / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If))
    out: dict[str, str] = {}
    for node in guarded.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname == alias.name  # an explicit re-export
            out[alias.name] = node.module
    return out


def test_the_package_exports_each_name_from_its_defining_module() -> None:
    homes: dict[str, str] = broker.core._HOMES
    assert _type_checking_exports() == homes
    for name, home in homes.items():
        value = getattr(broker.core, name)
        defined_in = getattr(value, "__module__", home)
        if isinstance(value, type) or callable(value):
            assert defined_in == home, f"{name} is defined in {defined_in}, exported from {home}"
    with pytest.raises(AttributeError):
        _ = broker.core.MachineBase  # type: ignore[attr-defined]


def test_importing_the_entry_codec_does_not_load_the_state_machine() -> None:
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, broker.core.entries; print('broker.core.state' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert loaded.stdout.strip() == "False"
