"""Driving the replicated state machine (broker/core/state.py) by hand in tests.

``Machine`` applies hand-built entries and checks the invariants after each; ``Trees`` adds
the task-tree helpers (spawn, finish, drain the tree effects); ``code`` asserts a rejection
and returns its error code.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from broker.core import (
    ApplyResult,
    Effect,
    ErrorCode,
    Rejected,
    StateMachine,
    StopRunning,
    TaskFinal,
    TaskRef,
    TaskState,
    TransactionRef,
    TreeEnded,
    TreeRecord,
    WorkerReconciled,
)
from broker.core import entries as e

T0: Final = 1_700_000_000_000


class Machine:
    """A StateMachine driven with hand-built entries, invariants checked after each."""

    def __init__(self, machine: StateMachine | None = None) -> None:
        self.m = machine if machine is not None else StateMachine()
        self.now = max(T0, self.m.now_ms)
        self.next_id = self.m.max_task_id
        self.next_txn = self.m.max_transaction_id
        self.effects: list[Effect] = []  # every effect apply returned, in order

    def apply(self, entry: e.Entry) -> ApplyResult:
        applied = self.m.apply(entry)
        self.effects.extend(applied.effects)
        self.m.check_invariants()
        return applied.result

    def at(self, advance_ms: int = 0) -> int:
        self.now += advance_ms
        return self.now

    def spec(self, tenant: str = "t", **fields: Any) -> e.TaskSpec:
        if "id" not in fields:
            self.next_id += 1
            fields["id"] = self.next_id
        return e.TaskSpec(type=fields.pop("type", "py"), tenant=tenant, **fields)

    def submit(self, *specs: e.TaskSpec) -> list[TaskRef | Rejected]:
        result = self.apply(e.SubmitTasks(time_ms=self.now, tasks=specs, v=e.submit_version(specs)))
        assert isinstance(result, list)
        return result

    def submit_one(self, tenant: str = "t", **fields: Any) -> TaskRef | Rejected:
        (result,) = self.submit(self.spec(tenant, **fields))
        return result

    def add(self, tenant: str = "t", **fields: Any) -> int:
        """Submit one task that must be accepted; its id."""
        result = self.submit_one(tenant, **fields)
        assert isinstance(result, TaskRef), result
        return result.id

    def state(self, task_id: int) -> str | None:
        task = self.m.tasks.get(task_id)
        return None if task is None else str(task.state)

    def tick(self, advance_ms: int = 0) -> None:
        assert self.apply(e.Tick(time_ms=self.at(advance_ms))) is None

    def register(
        self,
        worker_id: str = "w1",
        running: tuple[e.TaskAttempt, ...] = (),
        v: int = e.LOST_ATTEMPTS_VERSION,
    ) -> WorkerReconciled:
        """A registration as today's leader writes it when the worker holds tasks (``v``:
        an older leader's)."""
        entry = e.RegisterWorker(time_ms=self.now, worker_id=worker_id, running=running, v=v)
        result = self.apply(entry)
        assert isinstance(result, WorkerReconciled), result
        return result

    def worker_dead(self, worker_id: str = "w1", v: int = e.LOST_ATTEMPTS_VERSION) -> ApplyResult:
        """A death as today's leader writes it when the worker holds tasks (``v``: an
        older leader's)."""
        return self.apply(e.WorkerDead(time_ms=self.now, worker_id=worker_id, v=v))

    def assign(
        self, task_id: int, worker_id: str = "w1", v: int | None = None
    ) -> TaskRef | Rejected:
        """Assign as today's leader writes it (``v``: an older entry's version)."""
        entry = e.AssignTasks(
            time_ms=self.now,
            assignments=(e.Assignment(task_id, worker_id),),
            v=e.STARTS_RECORDED_VERSION if v is None else v,
        )
        result = self.apply(entry)
        assert isinstance(result, list) and len(result) == 1
        return result[0]

    def outcome(
        self,
        task_id: int,
        ok: bool = True,
        worker_id: str | None = None,
        attempt: int | None = None,
    ) -> e.TaskOutcome:
        task = self.m.tasks[task_id]
        return e.TaskOutcome(
            task_id=task_id,
            worker_id=worker_id if worker_id is not None else (task.worker or ""),
            attempt=attempt if attempt is not None else task.attempt,
            ok=ok,
            result=b"42" if ok else None,
            error=None if ok else "boom",
        )

    def finish(self, *outcomes: e.TaskOutcome) -> list[TaskRef | Rejected]:
        result = self.apply(e.FinishTasks(time_ms=self.now, outcomes=outcomes))
        assert isinstance(result, list)
        return result

    def cancel(self, task_id: int) -> ApplyResult:
        return self.apply(e.CancelTask(time_ms=self.now, task_id=task_id, reason="by test"))

    def begin(self, tenant: str = "t", ttl_ms: int = 10_000) -> int:
        self.next_txn += 1
        entry = e.BeginTransaction(
            time_ms=self.now, transaction_id=self.next_txn, tenant=tenant, ttl_ms=ttl_ms
        )
        result = self.apply(entry)
        assert result == TransactionRef(self.next_txn, tenant, self.now + ttl_ms)
        return self.next_txn

    def set_tenant(self, tenant: str = "t", **limits: Any) -> ApplyResult:
        patch = e.TenantLimitsPatch(**limits)
        return self.apply(e.SetTenant(time_ms=self.now, tenant=tenant, limits=patch))

    def waiting(self, tenant: str = "t") -> list[int]:
        return list(self.m.waiting.get(tenant, {}))


def code(result: object) -> ErrorCode:
    assert isinstance(result, Rejected), f"expected a rejection, got {result!r}"
    assert result.message
    return result.code


class Trees(Machine):
    def __init__(self, machine: StateMachine | None = None) -> None:
        super().__init__(machine)
        self.register("w1")

    def drain_effects(self) -> tuple[list[int], list[StopRunning]]:
        """Tasks that became final and running tasks stopped, since the last drain."""
        final = [x.task_id for x in self.effects if isinstance(x, TaskFinal)]
        stops = [x for x in self.effects if isinstance(x, StopRunning)]
        self.effects = [x for x in self.effects if isinstance(x, TreeEnded)]
        return final, stops

    def drain_tree_effects(self) -> list[int]:
        """Roots whose tree ended for good, since the last drain."""
        ended = [x.root_id for x in self.effects if isinstance(x, TreeEnded)]
        self.effects = [x for x in self.effects if not isinstance(x, TreeEnded)]
        return ended

    def root(self, **fields: Any) -> int:
        return self.add(track_tree=True, **fields)

    def tree(self, root: int) -> TreeRecord:
        tree = self.m.tree(root)
        assert tree is not None
        return tree

    def run(self, task_id: int) -> None:
        assert isinstance(self.assign(task_id), TaskRef)

    def child(self, *anchors: int, **fields: Any) -> e.Spawn:
        return e.Spawn(self.spec(**fields), anchors)

    def done(self, task_id: int, *spawn: e.Spawn) -> list[int]:
        """Run task_id (if waiting) and finish it ok with ``spawn``; the children's ids."""
        if self.state(task_id) == TaskState.WAITING.value:
            self.run(task_id)
        outcome = msgspec.structs.replace(self.outcome(task_id), spawn=spawn)
        (result,) = self.finish(outcome)
        assert result == TaskRef(task_id, TaskState.FINISHED.value)
        return [s.task.id for s in spawn]

    def fail(self, task_id: int) -> None:
        if self.state(task_id) == TaskState.WAITING.value:
            self.run(task_id)
        self.finish(self.outcome(task_id, ok=False))
