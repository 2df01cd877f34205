"""The state machine's workers and assignment: registration (reconciling the tasks a
worker reports), death, assignments (by the scheduler's AssignTasks, or carried by a
SubmitTasks entry) and finish reports, retries (docs/DESIGN.md §6).
"""

from __future__ import annotations

import math

from broker.core import entries as e
from broker.core.backoff import retry_delay_ms
from broker.core.books import Books
from broker.core.effects import AttemptLost, TaskAssigned
from broker.core.fit import (
    ANY_TYPE,
    fits,
    pool_of,
    resources_held,
    resources_left,
    within_global_limits,
)
from broker.core.indexes import TimerKind
from broker.core.records import (
    TASK_HOLDING_WORKER_STATES,
    ErrorCode,
    Rejected,
    ReplayedResults,
    Task,
    TaskRef,
    Worker,
    WorkerReconciled,
    WorkerState,
)
from broker.core.served_types import record_served_types
from broker.core.tasks import finished_ok, submit
from broker.core.transitions import TaskState
from broker.core.trees import spawn_refusal, start_tree, use_ids


def submit_placed(books: Books, entry: e.SubmitTasks) -> list[TaskRef | Rejected]:
    """A submit, then the assignments the leader placed in it: each starts only if no
    task was waiting before the entry, it is a task this entry created, the head of its
    tenant's queue, and it fits its worker as the scheduler counts (docs/DESIGN.md §6).
    A refused one waits for the scheduler; the result is the submit's either way."""
    if not entry.assignments:
        return submit(books, entry)
    idle = not books.queues.waiting_count
    results = submit(books, entry)
    if not idle or isinstance(results, ReplayedResults):
        return results
    created = {r.id for r in results if isinstance(r, TaskRef)}
    for assignment in entry.assignments:
        task = books.tasks.get(assignment.task_id)
        worker = books.workers.get(assignment.worker_id)
        if (
            task is not None
            and worker is not None
            and task.id in created
            and may_start(books, task, worker)
        ):
            start_on(books, task, worker, _records_starts(entry))
    return results


def may_start(books: Books, task: Task, worker: Worker) -> bool:
    """What the scheduler checks before it places ``task`` on ``worker``: the head of
    its tenant's queue, within the tenant's max_running, and the fit rule
    (broker/core/fit.py) on the state's counts."""
    if task.state != TaskState.WAITING or worker.state != WorkerState.CONNECTED:
        return False
    if books.queue_head(task.tenant) != task.id:
        return False  # not the head of its queue (or parked: code not ready)
    tenant = books.tenants.get(task.tenant)
    running_now = books.counts(task.tenant)[TaskState.RUNNING]
    if tenant is not None and 0 < tenant.max_running <= running_now:
        return False
    types = worker.task_types
    pool = pool_of(types, task.type)
    if pool is None:
        return False
    running = [books.tasks[i] for i in sorted(books.running.on(worker.id))]
    in_pool = sum(1 for t in running if pool_of(types, t.type) == pool)
    free = resources_left(worker.resources, running)
    if not fits(worker.tenants, task.tenant, types[pool] - in_pool, free, task.resources):
        return False
    limits = books.config.global_limits
    if limits and any(amount > 0 and name in limits for name, amount in task.resources.items()):
        used = resources_held(running_tasks(books), limits)
        return within_global_limits(task.resources, limits, used)
    return True


def running_tasks(books: Books) -> list[Task]:
    """Every running task, by worker and task id (so float sums are the same everywhere)."""
    by_worker = books.running.by_worker
    return [books.tasks[i] for w in sorted(by_worker) for i in sorted(by_worker[w])]


def start_on(books: Books, task: Task, worker: Worker, record_start: bool) -> None:
    if record_start:
        # A waiting task's updated_ms is when it became waiting: moves alone set it.
        task.queued_ms = books.now_ms - task.updated_ms
        task.started_ms = books.now_ms
    task.attempt += 1
    task.worker = worker.id
    books.move(task, TaskState.RUNNING)
    if task.root == task.id:
        start_tree(books, task.id)
    books.effects.append(TaskAssigned(task.id, worker.id, task.attempt))


def unreceived_attempts(
    books: Books,
    worker_id: str,
    process_id: str,
    credential: str | None,
    listed: tuple[e.TaskAttempt, ...],
) -> tuple[e.TaskAttempt, ...]:
    """The attempts running on ``worker_id`` that the reconnecting process, which lists
    every attempt it holds (running, or a report not acknowledged: ``listed``), never
    received: it is the very process (id and credential) registered now, so every
    attempt running on the worker was assigned to it (docs/DESIGN.md §6, "Lost
    assignments"). A read-only query for the leader, which gives them back in a
    ``FinishTasks`` before the ``RegisterWorker``; empty when it proves nothing."""
    worker = books.workers.get(worker_id)
    if (
        worker is None
        or not process_id
        or worker.process_id != process_id
        or worker.credential != credential
        or worker.state not in TASK_HOLDING_WORKER_STATES
    ):
        return ()  # another process (a restart) cannot tell what this one received
    held = {(ta.task_id, ta.attempt) for ta in listed}
    lost: list[e.TaskAttempt] = []
    for task_id in sorted(books.running.on(worker_id)):
        task = books.tasks[task_id]
        if (
            task.state == TaskState.RUNNING
            and task.worker == worker_id
            and (task.id, task.attempt) not in held
        ):
            lost.append(e.TaskAttempt(task.id, task.attempt))
    return tuple(lost)


def reconcile(
    books: Books, worker_id: str, running: tuple[e.TaskAttempt, ...]
) -> tuple[list[e.TaskAttempt], list[int]]:
    """The attempts running on ``worker_id`` that a registration reporting ``running``
    keeps, and the tasks whose attempts it does not report (lost)."""
    reported = {(r.task_id, r.attempt) for r in running}
    keep: list[e.TaskAttempt] = []
    lost: list[int] = []
    for task_id in sorted(books.running.on(worker_id)):
        task = books.tasks[task_id]
        if (task.id, task.attempt) in reported:
            keep.append(e.TaskAttempt(task.id, task.attempt))
        else:
            lost.append(task.id)
    return keep, lost


def registration_loses_attempts(
    books: Books, worker_id: str, running: tuple[e.TaskAttempt, ...]
) -> bool:
    """Whether a registration of ``worker_id`` reporting ``running`` would end attempts
    as lost: a read-only query for the leader, which then writes the RegisterWorker in
    format 5 (docs/DESIGN.md §6, "Lost workers"); a registration keeping all is not."""
    return bool(reconcile(books, worker_id, running)[1])


def register_worker(books: Books, entry: e.RegisterWorker) -> WorkerReconciled | Rejected:
    if not entry.worker_id:
        return Rejected(ErrorCode.INVALID, "worker_id must not be empty")
    if any(not (math.isfinite(a) and a >= 0) for a in entry.resources.values()) or any(
        n < 0 for n in entry.task_types.values()
    ):
        return Rejected(ErrorCode.INVALID, "worker capacities must be finite and >= 0")
    known = books.workers.get(entry.worker_id)
    if (
        known is not None
        and known.state in TASK_HOLDING_WORKER_STATES
        and known.credential != entry.credential
    ):
        # A worker id belongs to the credential it connected with until it is declared
        # dead: another credential must not take over its running tasks.
        return Rejected(
            ErrorCode.CONFLICT,
            f"worker id {entry.worker_id!r} is connected with another credential",
        )
    keep, lost = reconcile(books, entry.worker_id, entry.running)
    for task_id in lost:
        task = books.tasks[task_id]
        # A lost task whose tree failed because of an earlier one is already over.
        if task.state == TaskState.RUNNING and task.worker == entry.worker_id:
            lost_attempt(
                books, task, f"worker {entry.worker_id} came back without task {task.id}", entry.v
            )
    if len(lost):
        running = books.running.on(entry.worker_id)
        keep = [k for k in keep if k.task_id in running]
    worker = books.workers.get(entry.worker_id)
    if worker is None:
        worker = books.workers[entry.worker_id] = Worker(
            id=entry.worker_id,
            address=entry.address,
            process_id=entry.process_id,
            state=WorkerState.CONNECTED.value,
            connected_ms=books.now_ms,
            updated_ms=books.now_ms,
        )
    worker.address = entry.address
    worker.process_id = entry.process_id
    worker.state = WorkerState.CONNECTED.value
    worker.connected_ms = books.now_ms
    worker.updated_ms = books.now_ms
    worker.resources = {name: float(amount) for name, amount in entry.resources.items()}
    worker.task_types = dict(entry.task_types)
    worker.tenants = list(entry.tenants)
    worker.reason = None
    worker.credential = entry.credential
    worker.silent_since_ms = None  # heard from again
    worker.lists_task_names = entry.task_names is not None
    record_served_types(books, entry)
    books.worker_changed(worker)
    return WorkerReconciled(entry.worker_id, tuple(keep), tuple(lost))


def worker_dead(books: Books, entry: e.WorkerDead) -> Rejected | None:
    worker = books.workers.get(entry.worker_id)
    if worker is None:
        return Rejected(ErrorCode.NOT_FOUND, f"worker {entry.worker_id!r} is unknown")
    if entry.connected_ms is not None and entry.connected_ms != worker.connected_ms:
        return Rejected(ErrorCode.STALE, f"worker {worker.id} registered again since")
    worker.state = WorkerState.DEAD.value
    worker.updated_ms = books.now_ms
    worker.reason = entry.reason
    worker.silent_since_ms = None
    books.worker_changed(worker)
    for task_id in sorted(books.running.on(worker.id)):
        task = books.tasks[task_id]
        if task.state != TaskState.RUNNING or task.worker != worker.id:
            continue  # cancelled or replayed meanwhile: a failed tree of an earlier one
        lost_attempt(books, task, f"worker {worker.id} died: {entry.reason}", entry.v)
    return None


def worker_silent(books: Books, entry: e.WorkerSilent) -> None:
    """Each still connected worker of the registration the leader saw keeps the earliest
    silence, or forgets it when heard again (docs/DESIGN.md §8, "Silence across leader
    changes"); others are skipped: registered again or dead since. Bounded to
    [connected_ms, now_ms]: it was heard at its registration, and a silence cannot start
    in the future."""
    for silent in entry.workers:
        worker = connected_as(books, silent.worker_id, silent.connected_ms)
        if worker is None:
            continue
        if silent.since_ms is None:
            worker.silent_since_ms = None
            continue
        keep_earliest_silence(books, worker, silent.since_ms)


def worker_disconnected(books: Books, entry: e.WorkerDisconnected) -> None:
    """Each still connected worker of the registration the leader saw is disconnected:
    assigned nothing, its running tasks left running (presumed lost) until it registers
    again or is declared dead (docs/DESIGN.md §8, "Closed connections"); its last frame
    is kept as its silence, bounded as WorkerSilent's, so any leader judges it from
    then. Others are skipped: registered again, already disconnected, or dead since."""
    for closed in entry.workers:
        worker = connected_as(books, closed.worker_id, closed.connected_ms)
        if worker is None:
            continue
        worker.state = WorkerState.DISCONNECTED.value
        worker.updated_ms = books.now_ms
        keep_earliest_silence(books, worker, closed.last_seen_ms)
        books.worker_changed(worker)


def connected_as(books: Books, worker_id: str, connected_ms: int) -> Worker | None:
    """The worker, if still connected by the registration of ``connected_ms`` (the one
    the leader saw when it built the entry): a later registration wins, a dead or
    disconnected worker has nothing more to change."""
    worker = books.workers.get(worker_id)
    if (
        worker is None
        or worker.state != WorkerState.CONNECTED
        or worker.connected_ms != connected_ms
    ):
        return None
    return worker


def keep_earliest_silence(books: Books, worker: Worker, since_ms: int) -> None:
    """The earliest silence the log names, bounded to [connected_ms, now_ms]: it was
    heard at its registration, and a silence cannot start in the future."""
    since_ms = max(worker.connected_ms, min(since_ms, books.now_ms))
    if worker.silent_since_ms is None or since_ms < worker.silent_since_ms:
        worker.silent_since_ms = since_ms


def release(books: Books, task: Task, reason: str) -> None:
    """A stopping worker or broker gives the attempt back (docs/DESIGN.md §6,
    "Stopping"): the task waits again, the attempt does not count against
    max_attempts, and the worker, which is stopping, is assigned nothing more."""
    worker = books.workers.get(task.worker) if task.worker is not None else None
    if worker is not None:
        worker.task_types = {ANY_TYPE: 0}  # until it registers again
        books.worker_changed(worker)
    books.stop_if_running(task, reason)
    task.error = reason
    task.released += 1
    books.move(task, TaskState.WAITING)


def lost_attempt(books: Books, task: Task, error: str, entry_version: int) -> None:
    """The running attempt was lost with its worker (it died, or came back without the
    task): not the task's failure, so it does not count against max_attempts; the task
    waits again at once (no backoff: nothing went wrong with it), unless it has now
    lost more than max_lost attempts (docs/DESIGN.md §6, "Lost workers"). An entry
    older than the rule (an older leader's) applies the rule it was logged under: the
    attempt counts, as any failure."""
    if entry_version < e.LOST_ATTEMPTS_VERSION:
        retry_or_fail(books, task, error)
        return
    task.lost += 1
    books.effects.append(AttemptLost(task.id, task.worker or "", task.attempt))
    if task.lost > task.max_lost:
        task.error = f"{error} (lost {task.lost} times, max_lost {task.max_lost})"
        books.move(task, TaskState.ERROR)
        books.task_ended(task)
        return
    task.error = error
    books.move(task, TaskState.WAITING)


def retry_or_fail(books: Books, task: Task, error: str) -> None:
    task.error = error
    if task.counted_attempts() >= task.max_attempts:
        task.error = f"{error} (attempt {task.counted_attempts()} of {task.max_attempts})"
        books.move(task, TaskState.ERROR)
        books.task_ended(task)
        return
    delay_ms = retry_delay_ms(
        task.id, task.counted_attempts(), task.retry_backoff_ms, task.retry_backoff_max_ms
    )
    if delay_ms > 0:
        # Delayed until the retry is due: the due time is replicated state
        # (start_after_ms and its START timer), so it survives a failover.
        task.start_after_ms = books.now_ms + delay_ms
        books.move(task, TaskState.DELAYED)
        books.push_timer(task.start_after_ms, TimerKind.START, task.id)
    else:
        books.move(task, TaskState.WAITING)


def assign(books: Books, entry: e.AssignTasks) -> list[TaskRef | Rejected]:
    results: list[TaskRef | Rejected] = []
    for assignment in entry.assignments:
        task = books.tasks.get(assignment.task_id)
        worker = books.workers.get(assignment.worker_id)
        if task is None or task.state != TaskState.WAITING:
            results.append(Rejected(ErrorCode.STALE, f"task {assignment.task_id} not waiting"))
        elif worker is None or worker.state != WorkerState.CONNECTED:
            results.append(
                Rejected(ErrorCode.STALE, f"worker {assignment.worker_id} not connected")
            )
        elif task.waiting_for:
            results.append(
                Rejected(ErrorCode.STALE, f"task {task.id} waits for tasks {task.waiting_for}")
            )
        elif books.code_blocked(task):
            results.append(
                Rejected(
                    ErrorCode.STALE,
                    f"task {task.id} waits for code artifact {task.code} to be ready",
                )
            )
        else:
            start_on(books, task, worker, _records_starts(entry))
            results.append(TaskRef(task.id, task.state))
    return results


def finish(books: Books, entry: e.FinishTasks) -> list[TaskRef | Rejected]:
    results: list[TaskRef | Rejected] = []
    for outcome in entry.outcomes:
        task = books.tasks.get(outcome.task_id)
        if (
            task is None
            or task.state != TaskState.RUNNING
            or task.worker != outcome.worker_id
            or task.attempt != outcome.attempt
        ):
            # A duplicate or late report of an attempt that is over: spawns nothing.
            use_ids(books, outcome.spawn)
            results.append(Rejected(ErrorCode.STALE, f"task {outcome.task_id} not running"))
            continue
        refusal = spawn_refusal(books, outcome.spawn) if outcome.ok else None
        if outcome.released and not outcome.ok:
            use_ids(books, outcome.spawn)
            release(books, task, outcome.error or "given back")
        elif refusal is not None:
            # Nothing spawned: the attempt fails (and retries if it may), as any
            # error of the task would; the limit is read from the state being applied.
            use_ids(books, outcome.spawn)
            retry_or_fail(books, task, refusal)
        elif outcome.ok:
            task.result = outcome.result
            task.error = None
            books.move(task, TaskState.FINISHED)
            finished_ok(books, task, outcome.spawn)
        else:
            use_ids(books, outcome.spawn)
            retry_or_fail(books, task, outcome.error or "task failed")
        results.append(TaskRef(task.id, task.state))
    return results


def _records_starts(entry: e.AssignTasks | e.SubmitTasks) -> bool:
    """Whether ``entry`` records the start of the attempts it starts (format 5 on)."""
    return entry.v >= e.STARTS_RECORDED_VERSION
