"""The state machine's task trees, Storm's acker: a tracked root's tree completes when the
XOR of its live tasks' values is 0, and fails (then replays the root if it may) when one of
its tasks ends in error, is cancelled or the tree times out (docs/DESIGN.md §2).
"""

from __future__ import annotations

from collections.abc import Callable

from broker.core import entries as e
from broker.core.effects import TreeEnded
from broker.core.machine_base import MachineBase, _Timer
from broker.core.records import (
    _MASK64,
    FINAL_STATES,
    LIVE_STATES,
    Task,
    TreeRecord,
    TreeState,
    tree_value,
)
from broker.core.transitions import TaskState


class TreesMixin(MachineBase):
    """Task trees: start, ack, fail (cancel and replay) and end."""

    def tree(self, task_id: int) -> TreeRecord | None:
        """The tree record of a tracked root (None for other tasks)."""
        return self.trees.get(task_id)

    def _use_ids(self, spawn: tuple[e.Spawn, ...]) -> None:
        # Children not created still used up the ids the leader stamped for them.
        if spawn:
            self.max_task_id = max(self.max_task_id, *(s.task.id for s in spawn))

    def _spawn_refusal(self, spawn: tuple[e.Spawn, ...]) -> str | None:
        """Why a finish may not create these children: all of them would not fit in a
        tenant's max_waiting (each tenant counted once, in the children's order)."""
        if not spawn:
            return None
        counts: dict[str, int] = {}
        for child in spawn:
            counts[child.task.tenant] = counts.get(child.task.tenant, 0) + 1
        for name, count in counts.items():
            tenant = self.tenants.get(name)
            limit = tenant.max_waiting if tenant is not None else 0
            if limit and self._queued(name) + count > limit:
                return f"spawn refused: tenant {name!r} max_waiting {limit} reached"
        return None

    def _start_tree(self, root: int) -> None:
        """The root runs: its tree's timeout starts, once per run."""
        tree = self.trees.get(root)
        if tree is not None and tree.state == TreeState.PENDING and tree.deadline_ms is None:
            tree.deadline_ms = self.now_ms + tree.timeout_ms
            self._push_timer(tree.deadline_ms, _Timer.TREE_DEADLINE, root)

    def _tree_pending(self, root: int) -> bool:
        tree = self.trees.get(root)
        return tree is not None and tree.state == TreeState.PENDING

    def _in_tree(self, task_id: int, root: int) -> bool:
        task = self.tasks.get(task_id)
        return task is not None and task.root == root

    def _task_ended(self, task: Task) -> None:
        """A tree task ended in error or was cancelled: its tree fails at once."""
        if task.root is not None:
            tree = self.trees.get(task.root)
            if tree is not None and tree.state == TreeState.PENDING:
                how = "was cancelled" if task.state == TaskState.CANCELLED else "ended in error"
                self._fail_tree(tree, f"task {task.id} {how}")

    def _fail_tree(self, tree: TreeRecord, reason: str) -> None:
        """Cancel the tree's outstanding tasks, then replay the root if attempts remain."""
        tree.state = TreeState.FAILED.value
        tree.reason = reason
        root = self.tasks[tree.root]
        why = f"tree of task {root.id} failed: {reason}"
        for task_id in sorted(self.tree_live.get(root.id, ())):
            if task_id != root.id:
                task = self.tasks[task_id]
                task.error = why
                self._stop_if_running(task, why)
                self._move(task, TaskState.CANCELLED)
        replayable = (
            root.state not in (TaskState.ERROR, TaskState.CANCELLED)
            and root.counted_attempts() < root.max_attempts
            and (root.deadline_ms is None or root.deadline_ms > self.now_ms)
            # Its slot may have gone to another task since the root finished.
            and (root.slot is None or self.slots.get((root.tenant, root.slot), root.id) == root.id)
        )
        if not replayable:
            if root.state in LIVE_STATES:
                root.error = why
                self._stop_if_running(root, why)
                self._move(root, TaskState.CANCELLED)
            self._end_tree(tree, TreeState.FAILED)
            return
        root.error = f"{why}; replayed"
        if root.state == TaskState.RUNNING:
            self._stop_if_running(root, why)
            self._move(root, TaskState.WAITING)
        elif root.state == TaskState.FINISHED:
            root.result = None
            root.finished_ms = None
            if root.slot is not None:
                self.slots[(root.tenant, root.slot)] = root.id
            self._move(root, TaskState.WAITING)
            if root.deadline_ms is not None:
                self._push_timer(root.deadline_ms, _Timer.DEADLINE, root.id)
        # A fresh run: only the root is live in the tree now.
        tree.ack_val = tree_value(root.id)
        tree.attempt += 1
        tree.deadline_ms = None  # until the root runs again
        tree.state = TreeState.PENDING.value

    def _end_tree(self, tree: TreeRecord, state: TreeState) -> None:
        tree.state = state.value
        tree.ended_ms = self.now_ms
        if state == TreeState.COMPLETED:
            tree.reason = None
        self._effects.append(TreeEnded(tree.root))
        root = self.tasks[tree.root]
        if root.finished_ms is not None and root.state in FINAL_STATES:
            # Its purge was held back while the tree was pending.
            self._push_timer(self._purge_ms(root), _Timer.PURGE, root.id)

    def _check_tree_invariants(self, fail: Callable[[str], None]) -> None:
        # O(tasks): recompute each tree's live members and the XOR of their values.
        live: dict[int, set[int]] = {}
        xor: dict[int, int] = {}
        for task in self.tasks.values():
            if task.root is None or task.state not in LIVE_STATES:
                continue
            live.setdefault(task.root, set()).add(task.id)
            xor[task.root] = xor.get(task.root, 0) ^ tree_value(task.id)
        if live != self.tree_live:
            fail("tree_live index differs from the live tasks of trees")
        members: dict[int, set[int]] = {}
        for task in self.tasks.values():
            if task.root is not None:
                members.setdefault(task.root, set()).add(task.id)
        if members != self.tree_members:
            fail("tree_members index differs from the tasks of trees")
        for root_id, tree in self.trees.items():
            root = self.tasks.get(root_id)
            if tree.root != root_id or root is None or root.root != root_id:
                fail(f"tree record {tree.root} kept under {root_id} or without its root task")
            elif root.tenant != tree.tenant:
                fail(f"tree {root_id} of tenant {tree.tenant!r}, root's is {root.tenant!r}")
            if tree.state == TreeState.PENDING:
                if tree.ack_val != xor.get(root_id, 0):
                    fail(f"tree {root_id} ack val differs from the XOR of its live tasks")
                if tree.ack_val == 0:
                    fail(f"tree {root_id} is pending with ack val 0")
            elif root_id in live:
                fail(f"tree {root_id} is {tree.state} but tasks {sorted(live[root_id])} live")
            if not 0 <= tree.ack_val <= _MASK64 or tree.attempt < 1:
                fail(f"tree {root_id} ack val or attempt out of range")
        for root_id in live:
            if root_id not in self.trees:
                fail(f"live tasks of tree {root_id} that has no record")
