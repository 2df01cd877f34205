"""The state machine's records and parts, and the life of a task through them.

``Books`` holds the records (tasks, tenants, workers, transactions, trees, artifacts,
schedules ...) and composes the parts that index them, each a class with its own
invariant (broker/core/indexes.py, broker/core/capacity.py). It is the one owner of a
task's place in those parts: adding, moving (through the transition table only) and
deleting a task keeps every part in step, and what a move implies follows at once, in
order: a dependency's end releases or fails its dependants, a tree task's failure fails
its tree (cancel, then replay the root if it may), a tree's end re-arms its root's purge.

The subject handlers (tasks.py, transactions.py, workers.py, ...) are functions over a
``Books``; ``StateMachine`` (broker/core/state.py) is the books with ``apply`` dispatching
to them (docs/DESIGN.md §2, "The state machine's parts").
"""

from __future__ import annotations

from collections import deque

from broker.core.capacity import CapacityIndex
from broker.core.effects import Effect, TaskFinal, TreeEnded
from broker.core.indexes import (
    DependantsIndex,
    IdempotencyKeys,
    RunningIndex,
    SlotIndex,
    StateIndex,
    TaskQueues,
    TimerKind,
    Timers,
    TokenIndex,
    TreeIndex,
)
from broker.core.records import (
    FINAL_STATES,
    LIVE_STATES,
    QUEUED_STATES,
    Artifact,
    Config,
    Schedule,
    StopRunning,
    Task,
    Tenant,
    Transaction,
    TreeRecord,
    TreeState,
    Worker,
    tree_value,
)
from broker.core.transitions import TaskState, check_move


class Books:
    """The records, the parts that index them, and each task's moves through them."""

    def __init__(self) -> None:
        self.now_ms = 0
        self.max_task_id = 0
        self.max_transaction_id = 0
        self.config = Config()
        self.tasks: dict[int, Task] = {}
        self.tenants: dict[str, Tenant] = {}
        self.transactions: dict[int, Transaction] = {}
        self.workers: dict[str, Worker] = {}
        self.artifacts: dict[str, Artifact] = {}
        # Tracked trees by root id; a record lives as long as its root task.
        self.trees: dict[int, TreeRecord] = {}
        # (tenant, name) -> schedule, in creation order.
        self.schedules: dict[tuple[str, str], Schedule] = {}
        # Each webhook's outbox (tenant -> (event key, task id), in log order): the events
        # not yet logged as delivered, so any broker that loads this state delivers them,
        # whatever it replayed (docs/API.md, Webhooks). Only tenants with a webhook.
        self.webhook_outbox: dict[str, deque[tuple[tuple[int, int, int], int]]] = {}
        # The task type names workers ever listed, by the tenant they serve ("" for workers
        # serving every tenant), first listed first; and the tenants ("" too) over the cap,
        # whose submits are no longer checked (broker/core/served_types.py).
        self.served_types: dict[str, dict[str, None]] = {}
        self.served_types_full: set[str] = set()
        # The parts (broker/core/indexes.py).
        self.queues = TaskQueues()
        self.timers = Timers()
        self.states = StateIndex()
        self.slot_index = SlotIndex()
        self.running = RunningIndex()
        self.tree_index = TreeIndex()
        self.dependant_index = DependantsIndex()
        self.idempotency_keys = IdempotencyKeys()
        self.token_index = TokenIndex()
        # Free slots of the connected workers (derived, built on first use: ``capacity``).
        self._capacity: CapacityIndex | None = None
        self.entries_applied = 0
        # The log position of the entry being applied (the applier sets it): the first two
        # parts of the outbox's event keys. Not state: every replica applies each entry at
        # the same position.
        self.position: tuple[int, int] = (-1, -1)
        # The effects of the entry being applied, returned by apply (broker.core.effects);
        # not state.
        self.effects: list[Effect] = []
        # Dependencies that ended while their dependants were being handled (a failure
        # cascades along chains): handled in a loop, not by recursion. Not state.
        self._ended_dependencies: list[int] = []
        self._releasing = False

    def capacity(self) -> CapacityIndex:
        """The connected workers' free slots, as the scheduler reads them."""
        if self._capacity is None:
            self._capacity = CapacityIndex(self.workers, self.tasks, self.running.by_worker)
        return self._capacity

    def worker_changed(self, worker: Worker) -> None:
        """A worker's record changed (state, capacities, resources, tenants)."""
        if self._capacity is not None:
            self._capacity.reindex(worker, self.tasks, self.running.on(worker.id))

    def queue_head(self, tenant: str) -> int | None:
        """The task the scheduler would consider first for ``tenant``, or None."""
        return self.queues.head(tenant)

    # --- small reads and helpers ---------------------------------------------------------

    def counts(self, tenant: str) -> dict[str, int]:
        return self.states.counts(tenant)

    def tenant(self, name: str) -> Tenant:
        """The tenant, made with the defaults when first named."""
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name=name)
            self.counts(name)
        return tenant

    def queued(self, tenant: str) -> int:
        """How many of the tenant's tasks count against its max_waiting."""
        counts = self.counts(tenant)
        return sum(counts[s] for s in QUEUED_STATES)

    def code_blocked(self, task: Task) -> bool:
        """Whether the task's code artifact is not ready (then it may not be scheduled)."""
        code = task.code
        if code is None:
            return False
        artifact = self.artifacts.get(code)
        return artifact is not None and not artifact.ready

    def stop_if_running(self, task: Task, reason: str) -> None:
        if task.state == TaskState.RUNNING and task.worker is not None:
            self.effects.append(StopRunning(task.worker, task.id, task.attempt, reason))

    def purge_ms(self, task: Task) -> int:
        """When a final task is deleted; a root not before its tree's end + retention."""
        assert task.finished_ms is not None
        done_ms = task.finished_ms
        if task.root == task.id:
            tree = self.trees.get(task.id)
            if tree is not None and tree.ended_ms is not None:
                done_ms = max(done_ms, tree.ended_ms)
        return done_ms + self.config.finished_task_retention_ms

    def _slot_free_for(self, task: Task) -> bool:
        """Whether the task's slot (if any) is free or its own."""
        if task.slot is None:
            return True
        return self.slot_index.holder(task.tenant, task.slot) in (None, task.id)

    def tree_pending(self, root: int) -> bool:
        tree = self.trees.get(root)
        return tree is not None and tree.state == TreeState.PENDING

    # --- timers ------------------------------------------------------------------------

    def push_timer(self, due_ms: int, kind: TimerKind, ident: int) -> None:
        self.timers.push(due_ms, kind, ident)

    def _push_task_timers(self, task: Task, timers: Timers) -> None:
        if task.state == TaskState.DELAYED and task.start_after_ms is not None:
            timers.push(task.start_after_ms, TimerKind.START, task.id)
        if task.state in LIVE_STATES and task.deadline_ms is not None:
            timers.push(task.deadline_ms, TimerKind.DEADLINE, task.id)
        if task.state in FINAL_STATES and task.finished_ms is not None:
            timers.push(self.purge_ms(task), TimerKind.PURGE, task.id)

    def push_tree_timers(self) -> None:
        for tree in self.trees.values():
            if tree.state == TreeState.PENDING and tree.deadline_ms is not None:
                self.push_timer(tree.deadline_ms, TimerKind.TREE_DEADLINE, tree.root)

    def rebuild_timers(self) -> None:
        """Set the timers afresh (the purge times changed with the retention)."""
        self.timers = self.timers_rebuilt()

    def timers_rebuilt(self) -> Timers:
        """The timers the state needs, set afresh (moot ones left out)."""
        timers = Timers()
        for task in self.tasks.values():
            self._push_task_timers(task, timers)
        for txn in self.transactions.values():
            timers.push(txn.expires_ms, TimerKind.TXN_EXPIRE, txn.id)
        for tree in self.trees.values():
            if tree.state == TreeState.PENDING and tree.deadline_ms is not None:
                timers.push(tree.deadline_ms, TimerKind.TREE_DEADLINE, tree.root)
        return timers

    # --- a task's life -----------------------------------------------------------------

    def add_task(self, task: Task) -> None:
        self.tasks[task.id] = task
        self.states.added(task)
        if task.slot is not None and task.state in LIVE_STATES:
            self.slot_index.hold(task)
        if task.state == TaskState.WAITING:
            self.enqueue(task)
        elif task.state == TaskState.RUNNING and task.worker is not None:
            self._started(task.worker, task)
        self.tree_index.added(task)
        if task.waiting_for and task.state in LIVE_STATES:
            self.dependant_index.link(task)
        self._push_task_timers(task, self.timers)

    def enqueue(self, task: Task) -> None:
        """File a task that became waiting: in its tenant's queue, or parked on its code;
        nowhere while it waits for dependencies (the dependants index holds it)."""
        if task.waiting_for:
            return
        if task.code is not None and self.code_blocked(task):
            self.queues.park(task, task.code)
        else:
            self.queues.queue(task)

    def _dequeue(self, task: Task) -> None:
        # Readiness only goes from False to True, and readying releases every parked
        # task at once: a waiting task is parked exactly while its code is blocked.
        if task.waiting_for:
            return  # blocked: in no queue
        if task.code is not None and self.code_blocked(task):
            self.queues.unpark(task, task.code)
        else:
            self.queues.unqueue(task)

    def _started(self, worker_id: str, task: Task) -> None:
        self.running.started(worker_id, task.id)
        if self._capacity is not None:
            self._capacity.started(worker_id, task)

    def _stopped(self, worker_id: str, task: Task) -> None:
        self.running.stopped(worker_id, task.id)
        if self._capacity is not None:
            self._capacity.stopped(worker_id, task)

    def move(self, task: Task, new: TaskState) -> None:
        old = task.state
        if old == new:
            return
        check_move(old, new)  # an illegal move is a bug: apply is deterministic
        self.states.moved(task, old, new)
        if old == TaskState.WAITING:
            self._dequeue(task)
        elif old == TaskState.RUNNING and task.worker is not None:
            self._stopped(task.worker, task)
        elif old == TaskState.PENDING and task.transaction is not None:
            # Leaving a transaction other than by its commit (which pops it first).
            txn = self.transactions.get(task.transaction)
            if txn is not None:
                txn.task_ids.remove(task.id)
        if new == TaskState.WAITING:
            self.enqueue(task)
            task.worker = None
        elif new == TaskState.RUNNING and task.worker is not None:
            self._started(task.worker, task)
        if task.root is not None and (old in FINAL_STATES) != (new in FINAL_STATES):
            if new in FINAL_STATES:
                self.tree_index.ended(task)
            else:  # a root replayed
                self.tree_index.revived(task)
        task.state = new
        task.updated_ms = self.now_ms
        if new in FINAL_STATES:
            self.slot_index.free(task)
            self.effects.append(TaskFinal(task.id, new))
            task.finished_ms = self.now_ms
            if task.code is not None and (artifact := self.artifacts.get(task.code)):
                artifact.last_used_ms = self.now_ms  # code retention counts from here
            self.push_timer(
                self.now_ms + self.config.finished_task_retention_ms, TimerKind.PURGE, task.id
            )
            if task.waiting_for:
                self._unlink_dependencies(task)
            if task.id in self.dependant_index:
                self._dependency_ended(task)

    def delete_task(self, task: Task) -> None:
        check_move(task.state, None)
        del self.tasks[task.id]
        self.states.removed(task)
        if task.state == TaskState.WAITING:
            self._dequeue(task)
        elif task.state == TaskState.RUNNING and task.worker is not None:
            self._stopped(task.worker, task)
        self.slot_index.free(task)
        self.tree_index.removed(task)
        if task.waiting_for and task.state in LIVE_STATES:
            self._unlink_dependencies(task)
        if task.root == task.id:
            self.trees.pop(task.id, None)

    def _unlink_dependencies(self, task: Task) -> None:
        """A blocked task ended or was deleted: its dependencies no longer wait on it."""
        self.dependant_index.unlink(task)
        task.waiting_for = []

    # --- what a dependency's end implies (docs/DESIGN.md §2, "Dependencies") ------------

    def _dependency_ended(self, task: Task) -> None:
        self._ended_dependencies.append(task.id)
        if self._releasing:
            return  # the loop below, further up the stack, handles it
        self._releasing = True
        try:
            while self._ended_dependencies:
                self._release_dependants(self.tasks[self._ended_dependencies.pop(0)])
        finally:
            self._releasing = False

    def _release_dependants(self, dependency: Task) -> None:
        dependants = self.dependant_index.take(dependency.id)
        if not dependants:
            return
        finished = dependency.state == TaskState.FINISHED
        how = "was cancelled" if dependency.state == TaskState.CANCELLED else "failed"
        for task_id in dependants:  # in the order they started to wait: deterministic
            task = self.tasks[task_id]
            if finished:
                task.waiting_for.remove(dependency.id)
                if not task.waiting_for and task.state == TaskState.WAITING:
                    self.enqueue(task)
                continue
            if task.root is not None and task.root == dependency.root:
                # A join in the same tree: the dependency's end fails the tree, which
                # cancels this task with the tree's reason.
                continue
            if task.state not in LIVE_STATES:
                continue
            task.error = f"dependency {dependency.id} {how}"
            self.move(task, TaskState.ERROR)  # which unlinks it from its other dependencies
            self.task_ended(task)  # its tree fails with it

    # --- what a tree task's failure implies (docs/DESIGN.md §2, trees) ------------------

    def task_ended(self, task: Task) -> None:
        """A tree task ended in error or was cancelled: its tree fails at once."""
        if task.root is not None:
            tree = self.trees.get(task.root)
            if tree is not None and tree.state == TreeState.PENDING:
                how = "was cancelled" if task.state == TaskState.CANCELLED else "ended in error"
                self.fail_tree(tree, f"task {task.id} {how}")

    def fail_tree(self, tree: TreeRecord, reason: str) -> None:
        """Cancel the tree's outstanding tasks, then replay the root if attempts remain."""
        tree.state = TreeState.FAILED.value
        tree.reason = reason
        root = self.tasks[tree.root]
        why = f"tree of task {root.id} failed: {reason}"
        for task_id in sorted(self.tree_index.live.get(root.id, ())):
            if task_id != root.id:
                task = self.tasks[task_id]
                task.error = why
                self.stop_if_running(task, why)
                self.move(task, TaskState.CANCELLED)
        replayable = (
            root.state not in (TaskState.ERROR, TaskState.CANCELLED)
            and root.counted_attempts() < root.max_attempts
            and (root.deadline_ms is None or root.deadline_ms > self.now_ms)
            # Its slot may have gone to another task since the root finished.
            and (
                root.slot is None
                or self.slot_index.holder(root.tenant, root.slot) in (None, root.id)
            )
        )
        if not replayable:
            if root.state in LIVE_STATES:
                root.error = why
                self.stop_if_running(root, why)
                self.move(root, TaskState.CANCELLED)
            self.end_tree(tree, TreeState.FAILED)
            return
        root.error = f"{why}; replayed"
        if root.state == TaskState.RUNNING:
            self.stop_if_running(root, why)
            self.move(root, TaskState.WAITING)
        elif root.state == TaskState.FINISHED:
            root.result = None
            root.finished_ms = None
            if root.slot is not None:
                self.slot_index.hold(root)
            self.move(root, TaskState.WAITING)
            if root.deadline_ms is not None:
                self.push_timer(root.deadline_ms, TimerKind.DEADLINE, root.id)
        # A fresh run: only the root is live in the tree now.
        tree.ack_val = tree_value(root.id)
        tree.attempt += 1
        tree.deadline_ms = None  # until the root runs again
        tree.state = TreeState.PENDING.value

    def end_tree(self, tree: TreeRecord, state: TreeState) -> None:
        tree.state = state.value
        tree.ended_ms = self.now_ms
        if state == TreeState.COMPLETED:
            tree.reason = None
        self.effects.append(TreeEnded(tree.root))
        root = self.tasks[tree.root]
        if root.finished_ms is not None and root.state in FINAL_STATES:
            # Its purge was held back while the tree was pending.
            self.push_timer(self.purge_ms(root), TimerKind.PURGE, root.id)
