"""The state machine's task creation and cancellation: submissions (with idempotency keys),
children spawned by a finishing task, cancels (docs/DESIGN.md §6).
"""

from __future__ import annotations

from broker.core import entries as e
from broker.core.books import Books
from broker.core.dependencies import dependency_check
from broker.core.records import (
    FINAL_STATES,
    CancelCount,
    ErrorCode,
    Rejected,
    RememberedResult,
    ReplayedResults,
    SubmissionRecord,
    Task,
    TaskRef,
    Transaction,
    TreeRecord,
    TreeState,
    idempotency_scope,
    tree_value,
)
from broker.core.transactions import open_transaction
from broker.core.transitions import TaskState, check_move
from broker.core.trees import in_tree, use_ids
from broker.core.validation import (
    validate_idempotency_key,
    validate_task_spec,
)


def submit(books: Books, entry: e.SubmitTasks) -> list[TaskRef | Rejected]:
    key = entry.idempotency_key
    if key is None:
        return [submit_one(books, spec) for spec in entry.tasks]
    problem = validate_idempotency_key(key)
    scoped = (idempotency_scope(spec.tenant for spec in entry.tasks), key)
    record = books.idempotency_keys.get(scoped) if problem is None else None
    if problem is not None or record is not None:
        # The ids the leader stamped are used up, as a rejected spec's are.
        books.max_task_id = max([books.max_task_id, *(spec.id for spec in entry.tasks)])
        if record is None:
            return [Rejected(ErrorCode.INVALID, problem or "") for _ in entry.tasks]
        return ReplayedResults(
            TaskRef(r.task_id, r.state)
            if r.task_id is not None
            else Rejected(ErrorCode(r.state), r.message or "")
            for r in record.results
        )
    results = [submit_one(books, spec) for spec in entry.tasks]
    # A submission that created nothing is not remembered: a retry may try again
    # (e.g. once the tenant's queue has room) and still cannot duplicate anything.
    if any(isinstance(r, TaskRef) for r in results):
        books.idempotency_keys.remember(
            scoped,
            SubmissionRecord(
                key,
                books.now_ms,
                [
                    RememberedResult(r.id, r.state)
                    if isinstance(r, TaskRef)
                    else RememberedResult(None, r.code.value, r.message)
                    for r in results
                ],
                scoped[0],
            ),
        )
    return results


def submit_one(
    books: Books,
    spec: e.TaskSpec,
    *,
    root: int | None = None,
    parent: int | None = None,
    join: tuple[int, ...] = (),
) -> TaskRef | Rejected:
    """Create one task: submitted (parent None) or spawned by ``parent``'s finish,
    in the tree of ``root`` when anchored there; ``join``: the child's anchors other
    than its parent, which it waits for."""
    if spec.id <= books.max_task_id:
        return Rejected(ErrorCode.INVALID, f"task id {spec.id} was already used")
    books.max_task_id = spec.id
    problem = validate_task_spec(spec)
    if problem is not None:
        return Rejected(ErrorCode.INVALID, problem)
    now_ms = books.now_ms
    if spec.deadline_ms is not None and spec.deadline_ms <= now_ms:
        return Rejected(ErrorCode.INVALID, "deadline has already passed")
    txn: Transaction | None = None
    if spec.transaction is not None and parent is not None:
        return Rejected(ErrorCode.INVALID, "a spawned task cannot join a transaction")
    if spec.transaction is not None:
        txn = open_transaction(books, spec.transaction, spec.tenant)
        if txn is None:
            return Rejected(ErrorCode.NOT_FOUND, f"transaction {spec.transaction} is not open")
    if spec.code is not None and spec.code not in books.artifacts:
        return Rejected(ErrorCode.NOT_FOUND, f"code artifact {spec.code} was never uploaded")
    after = tuple(dict.fromkeys((*spec.after, *join)))
    waiting_for: list[int] = []
    if after:
        checked = dependency_check(books, spec.tenant, spec.after, join=False)
        if isinstance(checked, Rejected):
            return checked
        joined = dependency_check(books, spec.tenant, join, join=True)
        if isinstance(joined, Rejected):
            return joined
        waiting_for = list(dict.fromkeys((*checked, *joined)))
    holder = books.slot_index.holder(spec.tenant, spec.slot) if spec.slot is not None else None
    if holder is not None:
        return Rejected(ErrorCode.SLOT_BUSY, f"slot {spec.slot!r} is held by task {holder}")
    tenant = books.tenant(spec.tenant)
    # Spawned children count too; workers.finish checks a finish's children together first,
    # so a spawn over the limit fails its parent's attempt instead of losing some.
    if tenant.max_waiting and books.queued(spec.tenant) >= tenant.max_waiting:
        return Rejected(
            ErrorCode.TENANT_QUEUE_FULL,
            f"tenant {spec.tenant!r} already has {tenant.max_waiting} queued tasks "
            "(its max_waiting)",
        )
    if txn is not None:
        state = TaskState.PENDING
    elif spec.start_after_ms is not None and spec.start_after_ms > now_ms:
        state = TaskState.DELAYED
    else:
        state = TaskState.WAITING
    task = Task(
        id=spec.id,
        type=spec.type,
        tenant=spec.tenant,
        params=spec.params,
        state=state.value,
        created_ms=now_ms,
        updated_ms=now_ms,
        slot=spec.slot,
        max_attempts=spec.max_attempts,
        deadline_ms=spec.deadline_ms,
        start_after_ms=spec.start_after_ms,
        # float(): an int from an entry object (the leader's) must store as a follower's float.
        resources={name: float(amount) for name, amount in spec.resources.items()},
        transaction=spec.transaction,
        code=spec.code,
        root=root if root is not None else spec.id if spec.track_tree else None,
        parent=parent,
        after=list(after),
        waiting_for=waiting_for,
        priority=spec.priority,
        retry_backoff_ms=spec.retry_backoff_ms,
        retry_backoff_max_ms=spec.retry_backoff_max_ms,
        max_lost=spec.max_lost,
    )
    check_move(None, task.state)  # created (not in add_task: snapshot load uses it)
    books.add_task(task)
    if txn is not None:
        txn.task_ids.append(task.id)
    if root is None and spec.track_tree:
        books.trees[task.id] = TreeRecord(
            root=task.id,
            tenant=task.tenant,
            ack_val=tree_value(task.id),
            timeout_ms=spec.tree_timeout_ms,
        )
    return TaskRef(task.id, task.state)


def cancel(books: Books, entry: e.CancelTask) -> TaskRef | Rejected:
    task = books.tasks.get(entry.task_id)
    if task is None:
        return Rejected(ErrorCode.NOT_FOUND, f"task {entry.task_id} does not exist")
    if task.state in FINAL_STATES:
        return Rejected(ErrorCode.CONFLICT, f"task {task.id} is already {task.state}")
    task.error = entry.reason
    books.stop_if_running(task, entry.reason)
    books.move(task, TaskState.CANCELLED)
    books.task_ended(task)
    return TaskRef(task.id, task.state)


def cancel_many(books: Books, entry: e.CancelTasks) -> CancelCount | Rejected:
    if len(entry.task_ids) > e.MAX_CANCEL_BATCH:
        return Rejected(ErrorCode.INVALID, f"at most {e.MAX_CANCEL_BATCH} tasks per batch")
    cancelled = 0
    for task_id in entry.task_ids:
        task = books.tasks.get(task_id)
        if task is None or task.state in FINAL_STATES:
            continue  # ended since the leader chose it (or a duplicate id)
        if entry.tenant is not None and task.tenant != entry.tenant:
            continue
        cancel(books, e.CancelTask(time_ms=entry.time_ms, task_id=task_id, reason=entry.reason))
        cancelled += 1
    return CancelCount(cancelled, len(entry.task_ids) - cancelled)


def finished_ok(books: Books, task: Task, spawn: tuple[e.Spawn, ...]) -> None:
    """Create the children of a task that finished, then ack it in its tree."""
    tree = books.trees.get(task.root) if task.root is not None else None
    if tree is not None and tree.state != TreeState.PENDING:
        tree = None  # cannot happen: a failed or completed tree has no live task
    ack = tree_value(task.id) if tree is not None else 0
    failure: str | None = None
    for child in spawn:
        spec = child.task
        anchored = tree is not None and bool(child.anchors)
        if not anchored:
            # Unanchored, or anchored to an untracked task (a no-op, as in Storm).
            submit_one(books, spec, parent=task.id)
            continue
        assert tree is not None
        if failure is not None:
            use_ids(books, (child,))  # the tree failed: its later children are moot
            continue
        outside = [a for a in child.anchors if not in_tree(books, a, tree.root)]
        if outside:
            use_ids(books, (child,))
            failure = (
                f"task {task.id} anchored child {spec.id} to task {outside[0]}, "
                f"outside the tree of root {tree.root}"
            )
            continue
        # Anchors other than the parent make a join: the child waits for them.
        join = tuple(a for a in child.anchors if a != task.id)
        created = submit_one(books, spec, root=tree.root, parent=task.id, join=join)
        if isinstance(created, Rejected):
            failure = f"child {spec.id} of task {task.id} refused: {created.code.value}"
        else:
            ack ^= tree_value(spec.id)
    if tree is None:
        return
    tree.ack_val ^= ack  # children created and parent acked in one step, as Storm
    if failure is not None:
        books.fail_tree(tree, failure)
    elif tree.ack_val == 0:
        books.end_tree(tree, TreeState.COMPLETED)
