"""The state machine simulation's checks of results (tests/sim/test_simulation.py): every
result against the entry and the state, the atomicity of transactions, the node effects,
and the full rescan of the state.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from broker.core import (
    TASK_HOLDING_WORKER_STATES,
    ApplyResult,
    Artifact,
    CancelCount,
    ErrorCode,
    Rejected,
    ReplayedResults,
    StopRunning,
    TaskAssigned,
    TaskRef,
    TaskState,
    Tenant,
    TransactionDone,
    TransactionRef,
    TreeState,
    WorkerReconciled,
    WorkerState,
)
from broker.core import entries as e
from tests.support.sim_checks import RESULT_TYPES, Pre, TransitionChecks
from tests.support.sim_common import fail
from tests.support.sim_model import (
    CANCELLED,
    DELAYED,
    ERROR,
    FINAL,
    FINISHED,
    LIVE,
    PENDING,
    QUEUED,
    RUNNING,
    WAITING,
    Expect,
)


class Checker(TransitionChecks):
    """Independent checks on the primary replica, fed its transitions and results."""

    def after(self, entry: e.Entry, result: ApplyResult, expect: Expect, pre: Pre) -> None:
        events = self.last_events = self.m.events
        self.m.events = []
        self._check_events(entry, events, pre)
        self.check_placements(entry)
        self._check_trees(entry, result, events)
        # Timers fire before the handler, so the transitions above saw the old readiness.
        self._track_code(entry, result)
        self._check_idempotency(entry, result, events, pre)
        self._check_result(entry, result, expect, pre)
        self._check_transactions(entry, result, pre)

    def _check_result(self, entry: e.Entry, result: ApplyResult, expect: Expect, pre: Pre) -> None:
        m = self.m
        if isinstance(result, ReplayedResults):
            return  # compared with the first submission's results in _check_idempotency
        items: list[object]
        if isinstance(entry, e.SubmitTasks | e.AssignTasks | e.FinishTasks):
            if not isinstance(result, list):
                fail(f"{type(entry).__name__} returned {result!r}, not a list")
                return
            size = len(
                entry.tasks
                if isinstance(entry, e.SubmitTasks)
                else entry.assignments
                if isinstance(entry, e.AssignTasks)
                else entry.outcomes
            )
            if len(result) != size:
                fail(f"{len(result)} results for {size} items")
            items = list(result)
            for item in items:
                if not isinstance(item, TaskRef | Rejected):
                    fail(f"list item {item!r} is neither TaskRef nor Rejected")
        else:
            allowed = RESULT_TYPES[type(entry)]
            if not isinstance(result, allowed):
                fail(f"{type(entry).__name__} returned {result!r}")
            items = [result]
        for i, item in enumerate(items):
            if isinstance(item, Rejected):
                if not isinstance(item.code, ErrorCode):
                    fail(f"Rejected with a code that is no ErrorCode: {item!r}")
                if not isinstance(item.message, str) or not item.message:
                    fail(f"Rejected without a message: {item!r}")
                self.stats[f"{type(entry).__name__} rejected {item.code.value}"] += 1
                if i in expect.accept:
                    fail(f"item {i} had to be accepted, got {item!r}")
            else:
                self.stats[f"{type(entry).__name__} ok"] += 1
            codes = expect.reject.get(i)
            if codes is not None and not (isinstance(item, Rejected) and item.code in codes):
                fail(f"item {i} had to be rejected with {sorted(codes)}, got {item!r}")
        if isinstance(entry, e.SubmitTasks):
            self._check_submit(entry, items)
        elif isinstance(entry, e.AssignTasks | e.FinishTasks):
            ids = (
                [a.task_id for a in entry.assignments]
                if isinstance(entry, e.AssignTasks)
                else [o.task_id for o in entry.outcomes]
            )
            accepted = [
                tid for tid, item in zip(ids, items, strict=True) if isinstance(item, TaskRef)
            ]
            if len(accepted) != len(set(accepted)):
                fail(f"a task was accepted twice in one entry: {accepted}")
            for i, item in enumerate(items):
                if isinstance(item, Rejected) and item.code != ErrorCode.STALE:
                    fail(f"assign/finish rejected with {item.code}, expected stale")
                if isinstance(item, Rejected) and any(ids[i] in p for p in self.parked.values()):
                    self.stats["assign of a parked task rejected"] += 1
                if isinstance(item, TaskRef):
                    task = m.tasks.get(item.id)
                    if task is None or item.id != ids[i]:
                        fail(f"TaskRef {item!r} for item {ids[i]}")
                    elif isinstance(entry, e.AssignTasks):
                        if item.state != RUNNING or task.worker != entry.assignments[i].worker_id:
                            fail(f"assignment result {item!r}, task on {task.worker}")
                    elif item.state not in (FINISHED, WAITING, DELAYED, ERROR):
                        fail(f"finish result {item!r}")
        elif isinstance(entry, e.CancelTask):
            item = items[0]
            if isinstance(item, TaskRef):
                task = m.tasks.get(item.id)
                if item.id != entry.task_id or item.state != CANCELLED or task is None:
                    fail(f"cancel result {item!r}")
                elif task.state != CANCELLED or task.error != entry.reason:
                    fail(f"cancelled task {task.id} is {task.state} with error {task.error!r}")
            elif isinstance(item, Rejected):
                task = m.tasks.get(entry.task_id)
                if item.code == ErrorCode.NOT_FOUND and task is not None:
                    fail(f"cancel said not_found for existing task {entry.task_id}")
                if item.code == ErrorCode.CONFLICT and (task is None or task.state not in FINAL):
                    fail(f"cancel said conflict for task {entry.task_id} not final")
                if item.code not in (ErrorCode.NOT_FOUND, ErrorCode.CONFLICT):
                    fail(f"cancel rejected with {item.code}")
        elif isinstance(entry, e.CancelTasks):
            item = items[0]
            if isinstance(item, CancelCount):
                if item.cancelled < 0 or item.cancelled + item.skipped != len(entry.task_ids):
                    fail(f"bulk cancel of {len(entry.task_ids)} ids answered {item!r}")
                for task_id in entry.task_ids:
                    task = m.tasks.get(task_id)
                    if task is not None and task.error == entry.reason and task.state != CANCELLED:
                        fail(f"task {task_id} has the bulk cancel's reason but is {task.state}")
            elif len(entry.task_ids) <= e.MAX_CANCEL_BATCH:
                fail(f"bulk cancel of {len(entry.task_ids)} ids refused: {item!r}")
        elif isinstance(entry, e.BeginTransaction):
            item = items[0]
            if isinstance(item, TransactionRef):
                txn = m.transactions.get(entry.transaction_id)
                if (
                    txn is None
                    or item.id != entry.transaction_id
                    or item.tenant != entry.tenant
                    or item.expires_ms != m.now_ms + entry.ttl_ms
                    or txn.expires_ms != item.expires_ms
                    or txn.task_ids
                ):
                    fail(f"begin result {item!r} vs {txn!r}")
                if entry.tenant not in m.tenants:
                    fail(f"begin did not create tenant {entry.tenant!r}")
        elif isinstance(entry, e.SetTenant):
            item = items[0]
            if isinstance(item, Tenant):
                limits = entry.limits
                tenant = m.tenants.get(entry.tenant)
                if tenant is None or msgspec.to_builtins(tenant) != msgspec.to_builtins(item):
                    fail(f"set tenant result {item!r} differs from state {tenant!r}")
                for name in ("max_waiting", "max_running", "weight"):
                    wanted = getattr(limits, name)
                    if wanted is not None and getattr(item, name) != wanted:
                        fail(f"tenant {item.name} {name} is {getattr(item, name)}, set {wanted}")
        elif isinstance(entry, e.SetConfig) and result is None:
            wanted = entry.finished_task_retention_ms
            if wanted is not None and wanted > 0 and m.config.finished_task_retention_ms != wanted:
                fail(f"retention not set to {wanted}")
            if entry.global_limits is not None and m.config.global_limits != entry.global_limits:
                fail(f"global limits not set to {entry.global_limits}")
        elif isinstance(entry, e.RegisterWorker) and isinstance(result, WorkerReconciled):
            worker = m.workers.get(entry.worker_id)
            if worker is None or worker.state != WorkerState.CONNECTED:
                fail(f"registered worker {entry.worker_id!r} is not connected")
            if worker is not None and worker.silent_since_ms is not None:
                fail(f"registered worker {entry.worker_id!r} still silent")
            reported = {(r.task_id, r.attempt) for r in entry.running}
            keep = {(k.task_id, k.attempt) for k in result.keep}
            # What it ran when the handler started: less the tasks whose deadline just fired.
            had = {
                (tid, attempt)
                for tid, attempt in pre.reported
                if not self._deadline_error(m.tasks[tid], m.now_ms)
            }
            # Less the kept ones cancelled or replayed since: a lost task failed their tree.
            still = {(t.id, t.attempt) for t in m.tasks.values() if t.worker == entry.worker_id}
            left = {(tid, a) for tid, a in had & reported if (tid, a) not in keep}
            for tid, attempt in left:
                task = m.tasks[tid]
                if ((tid, attempt) in still and task.state == RUNNING) or task.root is None:
                    fail(f"reported task {tid} neither kept nor ended by its tree")
                self.stats["reconcile kept task ended by its tree"] += 1
            if result.worker_id != entry.worker_id or keep != (had & reported) - left:
                fail(f"reconcile kept {sorted(keep)}; had {sorted(had)}")
            self.stats["reconcile lost"] += len(result.lost)
            self.stats["reconcile kept"] += len(result.keep)
            gone = {tid for tid, _ in had - reported}
            for tid in gone - set(result.lost):  # ended by a tree's timeout before
                task = m.tasks[tid]
                if task.root is None or task.state not in (CANCELLED, WAITING):
                    fail(f"task {tid} neither lost nor ended by its tree")
            if not set(result.lost) <= gone:
                fail(f"reconcile lost {result.lost}; had {sorted(had)}")
            for tid in result.lost:
                if m.tasks[tid].state not in (WAITING, DELAYED, ERROR, CANCELLED):
                    fail(f"lost task {tid} is {m.tasks[tid].state}")
            if set(m.running_by_worker.get(entry.worker_id, ())) != {t for t, _ in keep}:
                fail(f"worker {entry.worker_id} runs other tasks than the kept ones")
        elif isinstance(entry, e.AddCode | e.CodeReady) and isinstance(result, Artifact):
            if m.artifacts.get(entry.sha256) is not result or result.sha256 != entry.sha256:
                fail(f"artifact {entry.sha256} not stored: {result!r}")
            if result.ready != self.code_ready[entry.sha256]:
                fail(f"artifact {entry.sha256} ready={result.ready}, entries say otherwise")
            if result.ready and entry.sha256 in m.parked:
                fail(f"tasks still parked on ready artifact {entry.sha256}")
        elif isinstance(entry, e.DeleteCode) and isinstance(result, Artifact):
            # The sim's uploads are shared (no tenant): an applied delete deletes.
            if entry.sha256 in m.artifacts or m.code_users(entry.sha256):
                fail(f"artifact {entry.sha256} deleted but still known or used")
            if entry.unused_for_ms and (
                max(result.created_ms, result.last_used_ms) + entry.unused_for_ms > m.now_ms
            ):
                fail(f"artifact {entry.sha256} deleted by retention before it was due")
        elif isinstance(entry, e.WorkerSilent):
            self._check_silent(entry)
        elif isinstance(entry, e.WorkerDisconnected):
            self._check_disconnected(entry, pre)
        elif isinstance(entry, e.WorkerDead) and result is None:
            worker = m.workers[entry.worker_id]
            if worker.state != WorkerState.DEAD or m.running_by_worker.get(worker.id):
                fail(f"dead worker {worker.id} is {worker.state} or still runs tasks")

    def _check_disconnected(self, entry: e.WorkerDisconnected, pre: Pre) -> None:
        """Each connected worker of the registration named is disconnected, its running
        tasks left running, silent since at most its last frame (bounded by its
        registration and now); others are left as they were."""
        m = self.m
        for closed in entry.workers:
            worker = m.workers.get(closed.worker_id)
            if worker is None:
                continue
            was = pre.worker_states.get(worker.id)
            if was != WorkerState.CONNECTED or worker.connected_ms != closed.connected_ms:
                if worker.state != was:
                    fail(f"worker {worker.id} went from {was} to {worker.state}: not its close")
                continue
            if worker.state != WorkerState.DISCONNECTED:
                fail(f"worker {worker.id} closed its connection but is {worker.state}")
            bound = max(worker.connected_ms, min(closed.last_seen_ms, m.now_ms))
            since = worker.silent_since_ms
            if since is None or since > bound:
                fail(f"disconnected worker {worker.id} silent since {since}, its close {bound}")
            self.stats["worker disconnected"] += 1
            for tid in m.running_by_worker.get(worker.id, ()):
                if tid not in pre.running_lost:
                    fail(f"task {tid} started on worker {worker.id} as it disconnected")
                self.stats["task lost? with its disconnected worker"] += 1
        for tid, lost in pre.running_lost.items():
            task = m.tasks.get(tid)
            if task is not None and task.lost != lost:
                fail(f"task {tid} counted lost when its worker disconnected")

    def _check_silent(self, entry: e.WorkerSilent) -> None:
        """Each connected worker of the registration named keeps the earliest silence, at
        most the entry's own (bounded by its registration and now), or none when heard."""
        m = self.m
        for silent in entry.workers:
            worker = m.workers.get(silent.worker_id)
            if (
                worker is None
                or worker.state != WorkerState.CONNECTED
                or worker.connected_ms != silent.connected_ms
            ):
                continue
            since = worker.silent_since_ms
            if silent.since_ms is None:
                if since is not None:
                    fail(f"worker {worker.id} heard again but still silent since {since}")
                self.stats["worker heard again"] += 1
                continue
            bound = max(worker.connected_ms, min(silent.since_ms, m.now_ms))
            if since is None or since > bound:
                fail(f"worker {worker.id} silent since {since}, the entry says {bound}")
            self.stats["worker silent"] += 1

    def _check_submit(self, entry: e.SubmitTasks, items: list[object]) -> None:
        m = self.m
        now = m.now_ms
        # Queued count of each tenant just before each spec was applied: nothing
        # leaves a queue during a submission but the tasks it placed (after all were
        # created), so count back from the end, those counted as queued.
        placed = {ev.task_id for ev in self.last_events if ev.new == RUNNING}
        queued_after: dict[str, int] = {}
        queued_before: list[int] = []
        for spec, item in reversed(list(zip(entry.tasks, items, strict=True))):
            if spec.tenant not in queued_after:
                counts = m.tenant_counts_view(spec.tenant)
                started = sum(1 for tid in placed if m.tasks[tid].tenant == spec.tenant)
                queued_after[spec.tenant] = sum(counts[s] for s in QUEUED) + started
            if isinstance(item, TaskRef):
                queued_after[spec.tenant] -= 1
            queued_before.append(queued_after[spec.tenant])
        queued_before.reverse()
        for spec, item, queued in zip(entry.tasks, items, queued_before, strict=True):
            limit = m.tenants[spec.tenant].max_waiting if spec.tenant in m.tenants else 0
            if isinstance(item, TaskRef) and limit and queued >= limit:
                fail(f"task {spec.id} accepted with {queued} queued, max_waiting {limit}")
            full = isinstance(item, Rejected) and item.code == ErrorCode.TENANT_QUEUE_FULL
            if full and not 0 < limit <= queued:
                fail(f"queue full for {spec.tenant} with {queued} queued, max {limit}")
            task = m.tasks.get(spec.id)
            if isinstance(item, TaskRef):
                as_created = task.state if task is None or task.id not in placed else WAITING
                if item.id != spec.id or task is None or as_created != item.state:
                    fail(f"submit result {item!r} but task is {task!r}")
                    return
                if spec.transaction is not None:
                    expected = PENDING
                elif spec.start_after_ms is not None and spec.start_after_ms > now:
                    expected = DELAYED
                else:
                    expected = WAITING
                if item.state != expected:
                    fail(f"task {spec.id} submitted as {item.state}, expected {expected}")
                if spec.slot is not None and m.slots.get((spec.tenant, spec.slot)) != spec.id:
                    fail(f"task {spec.id} accepted but does not hold slot {spec.slot!r}")
                if spec.transaction is not None:
                    txn = m.transactions.get(spec.transaction)
                    if txn is None or txn.tenant != spec.tenant or spec.id not in txn.task_ids:
                        fail(f"task {spec.id} accepted into transaction {spec.transaction} wrongly")
                    self.txn_members.setdefault(spec.transaction, set()).add(spec.id)
                if (task.type, task.tenant, task.params, task.slot, task.max_attempts) != (
                    spec.type,
                    spec.tenant,
                    spec.params,
                    spec.slot,
                    spec.max_attempts,
                ) or (task.priority, task.retry_backoff_ms, task.retry_backoff_max_ms) != (
                    spec.priority,
                    spec.retry_backoff_ms,
                    spec.retry_backoff_max_ms,
                ):
                    fail(f"task {spec.id} stored differently from its spec")
            elif isinstance(item, Rejected):
                if item.code == ErrorCode.INVALID:
                    continue  # the task may exist under this id (a reused id)
                if task is not None:
                    fail(f"rejected spec {spec.id} created a task")
                if item.code == ErrorCode.SLOT_BUSY:
                    holder = m.slots.get((spec.tenant, spec.slot or ""))
                    if holder is None or holder == spec.id or m.tasks[holder].state not in LIVE:
                        fail(f"slot {spec.slot!r} busy but held by {holder}")
                elif item.code == ErrorCode.TENANT_QUEUE_FULL:
                    pass  # checked above
                elif item.code == ErrorCode.NOT_FOUND:
                    txn = m.transactions.get(spec.transaction or 0)
                    # Another tenant's transaction is not open to this one.
                    no_txn = spec.transaction is not None and (
                        txn is None or txn.tenant != spec.tenant
                    )
                    no_code = spec.code is not None and spec.code not in m.artifacts
                    no_dep = any(
                        (dep := m.tasks.get(d)) is None or dep.tenant != spec.tenant
                        for d in spec.after
                    )
                    if not (no_txn or no_code or no_dep):
                        fail(f"not_found for spec {spec.id} with txn {spec.transaction}")
                elif item.code == ErrorCode.CONFLICT:
                    ended = (TaskState.ERROR, TaskState.CANCELLED)
                    if not any((d := m.tasks.get(i)) and d.state in ended for i in spec.after):
                        fail(f"conflict for spec {spec.id} though no dependency failed")
                else:
                    fail(f"submit rejected with {item.code}")

    # --- transactions are atomic ---------------------------------------------------------------

    def _check_transactions(self, entry: e.Entry, result: ApplyResult, pre: Pre) -> None:
        m = self.m
        closed = pre.open_txns - m.transactions.keys()
        for txn_id in closed:
            members = self.txn_members.pop(txn_id, set())
            committed = (
                isinstance(entry, e.CommitTransaction)
                and entry.transaction_id == txn_id
                and isinstance(result, TransactionDone)
            )
            for tid in members:
                task = m.tasks.get(tid)
                if committed:
                    assert isinstance(result, TransactionDone)
                    if tid in result.task_ids:
                        if task is None or task.state not in (WAITING, DELAYED):
                            fail(f"committed task {tid} of txn {txn_id} is {task!r}")
                    elif task is not None and task.state not in FINAL:
                        fail(f"task {tid} of committed txn {txn_id} left out: {task!r}")
                elif task is not None and task.state not in FINAL:
                    fail(f"task {tid} of rolled back / expired txn {txn_id} is {task.state}")
            if isinstance(result, TransactionDone) and result.id == txn_id:
                self.stats[f"txn {result.outcome}"] += 1
                if result.outcome not in ("committed", "rolled_back"):
                    fail(f"transaction outcome {result.outcome!r}")
                if result.outcome == "committed" and not committed:
                    fail("commit result for an entry that is no commit")
                if result.outcome == "rolled_back":
                    if not isinstance(entry, e.RollbackTransaction):
                        fail("rollback result for an entry that is no rollback")
                    for tid in result.task_ids:
                        if tid in m.tasks:
                            fail(f"rolled back task {tid} still exists")
                if pre.txn_tasks is None or not set(result.task_ids) <= set(pre.txn_tasks):
                    fail(f"transaction result {result!r} lists foreign tasks")
            else:
                self.stats["txn expired"] += 1
        if isinstance(result, TransactionDone) and result.id not in closed:
            fail(f"transaction {result.id} reported done but was not open")

    # --- effects for the node's listeners ----------------------------------------------------

    def check_effects(
        self,
        entry: e.Entry,
        final: list[int],
        stops: list[StopRunning],
        assigned: list[TaskAssigned] | None = None,
    ) -> None:
        """A replica's effects (returned by apply) against this entry's transitions; every
        attempt is started (sent to a worker) at most once."""
        now = self.m.now_ms
        expected_final: list[int] = []
        expected_stops: list[StopRunning] = []
        expected_assigned = [
            TaskAssigned(ev.task_id, ev.task.worker or "", ev.attempt)
            for ev in self.last_events
            if ev.new == RUNNING and ev.old == WAITING
        ]
        if assigned is not None:
            if assigned != expected_assigned:
                fail(f"effects: assigned {assigned}, transitions say {expected_assigned}")
            for started in assigned:
                if (started.task_id, started.attempt) in self.started:
                    fail(f"task {started.task_id} attempt {started.attempt} started twice")
                self.started.add((started.task_id, started.attempt))
        for ev in self.last_events:
            if ev.new in FINAL:
                expected_final.append(ev.task_id)
            error = ev.task.error or ""
            if ev.old == RUNNING and ev.new == CANCELLED:
                cancel = isinstance(entry, e.CancelTask | e.CancelTasks)
                reason = entry.reason if cancel else error
                if error.startswith("tree of task"):
                    reason = error  # its tree failed (perhaps because of this very cancel)
                expected_stops.append(
                    StopRunning(ev.task.worker or "", ev.task_id, ev.attempt, reason)
                )
            elif ev.old == RUNNING and ev.new == WAITING and self._given_back(entry, ev.task):
                # Given back: stopped on the worker the outcome names (cleared since).
                assert isinstance(entry, e.FinishTasks)
                worker = next(o.worker_id for o in entry.outcomes if o.task_id == ev.task_id)
                expected_stops.append(StopRunning(worker, ev.task_id, ev.attempt, error))
            elif ev.old == RUNNING and ev.new == WAITING and ev.task.root == ev.task_id:
                # A replayed root: stopped on the worker it ran on (cleared since).
                actual = next((s for s in stops if s.task_id == ev.task_id), None)
                if error.endswith("; replayed"):
                    worker = actual.worker_id if actual is not None else ""
                    expected_stops.append(
                        StopRunning(worker, ev.task_id, ev.attempt, error[: -len("; replayed")])
                    )
                elif (
                    actual is not None
                    and actual.attempt == ev.attempt
                    and (ev.task.state != WAITING or "tree of task" in actual.reason)
                ):
                    expected_stops.append(actual)  # changed again later in the entry
            elif ev.old == RUNNING and ev.new == ERROR and self._deadline_error(ev.task, now):
                expected_stops.append(
                    StopRunning(ev.task.worker or "", ev.task_id, ev.attempt, "deadline exceeded")
                )
        self.stats["effect stop running"] += len(stops)
        if final != expected_final:
            fail(f"effects: became final {final}, transitions say {expected_final}")
        if stops != expected_stops:
            fail(f"effects: stop running {stops}, transitions say {expected_stops}")

    # --- full independent scan -------------------------------------------------------------

    def full_scan(self, after_config: bool) -> None:
        m = self.m
        now = m.now_ms
        actual = {tid: str(task.state) for tid, task in m.tasks.items()}
        if actual != self.mirror:
            diff = {
                tid: (self.mirror.get(tid), actual.get(tid))
                for tid in set(actual) | set(self.mirror)
                if self.mirror.get(tid) != actual.get(tid)
            }
            fail(f"task states changed outside the traced transitions: {sorted(diff.items())[:5]}")
        recount: Counter[str] = Counter()
        per_tenant: dict[str, Counter[str]] = {}
        holders: dict[tuple[str, str], int] = {}  # by (tenant, slot): slots are per tenant
        for tid, task in m.tasks.items():
            state = str(task.state)
            recount[state] += 1
            per_tenant.setdefault(task.tenant, Counter())[state] += 1
            if self.attempts.get(tid) != task.attempt:
                fail(f"task {tid} attempt changed outside a transition: {task.attempt}")
            if not 0 <= task.counted_attempts() <= task.max_attempts:
                fail(f"task {tid} attempt {task.attempt} of max {task.max_attempts}")
            if task.lost != self.lost.get(tid) or task.lost > task.max_lost + 1:
                fail(f"task {tid} lost {task.lost} attempts, the entries say {self.lost.get(tid)}")
            if state in LIVE and task.slot is not None:
                slot = (task.tenant, task.slot)
                if slot in holders:
                    fail(f"slot {slot!r} held by live tasks {holders[slot]} and {tid}")
                holders[slot] = tid
            if state in LIVE and task.deadline_ms is not None and task.deadline_ms <= now:
                fail(f"live task {tid} past its deadline {task.deadline_ms} (now {now})")
            if state == DELAYED and (task.start_after_ms is None or task.start_after_ms <= now):
                fail(f"delayed task {tid} past its start_after {task.start_after_ms}")
            counted = task.counted_attempts()
            if state == WAITING and (task.worker is not None or counted >= task.max_attempts):
                fail(f"waiting task {tid}: worker {task.worker}, attempt {task.attempt}")
            if state in (WAITING, RUNNING) and (task.start_after_ms or 0) > now:
                fail(f"{state} task {tid} before its start_after {task.start_after_ms}")
            if state == RUNNING and task.code is not None and not m.artifacts[task.code].ready:
                fail(f"running task {tid} uses code {task.code} that is not ready")
            if state == RUNNING:
                worker = m.workers.get(task.worker or "")
                if (
                    worker is None
                    or worker.state not in TASK_HOLDING_WORKER_STATES
                    or task.attempt < 1
                ):
                    fail(f"running task {tid} on {task.worker} at attempt {task.attempt}")
            if state == PENDING:
                txn = m.transactions.get(task.transaction or 0)
                if txn is None or txn.tenant != task.tenant or tid not in txn.task_ids:
                    fail(f"pending task {tid} not in its open transaction {task.transaction}")
            if state in FINAL:
                if task.finished_ms is None:
                    fail(f"final task {tid} has no finished_ms")
                elif (
                    not after_config
                    and task.finished_ms + m.config.finished_task_retention_ms <= now
                    # A root outlives its pending tree (it may be replayed), and is kept
                    # the retention after its tree's end.
                    and self.tree_status.get(tid) != TreeState.PENDING
                    and not self._tree_kept(tid, now)
                ):
                    fail(f"final task {tid} outlived its retention")
            if state == FINISHED and task.attempt < 1:
                fail(f"task {tid} finished without running")
        counts = m.count_by_state()
        for state in TaskState:
            if counts.get(state.value, 0) != recount[state.value]:
                fail(f"count_by_state {counts} != recount {dict(recount)}")
        for name in set(per_tenant) | set(m.tenants):
            view = m.tenant_counts_view(name)
            for state in TaskState:
                if view[state.value] != per_tenant.get(name, Counter())[state.value]:
                    fail(f"tenant {name} counts {view} != recount {per_tenant.get(name)}")
        actual_queues = {t: list(q) for t, q in m.waiting.items() if q}
        expected_queues = {t: list(q) for t, q in self.queues.items() if q}
        if actual_queues != expected_queues:
            fail("waiting queues are not in arrival (FIFO) order")
        actual_parked = {sha: set(ids) for sha, ids in m.parked.items()}
        expected_parked = {sha: ids for sha, ids in self.parked.items() if ids}
        if actual_parked != expected_parked:
            fail(f"parked tasks {actual_parked} differ from expected {expected_parked}")
        for txn in m.transactions.values():
            if txn.expires_ms <= now:
                fail(f"transaction {txn.id} outlived its TTL")
        if len(set(m.slots.values())) != len(m.slots):
            fail("one task holds several slots")
        keys = [(key, record.created_ms) for key, record in m.idempotency.items()]
        if keys != [(key, first_ms) for key, (first_ms, _) in self.keys.items()]:
            fail(f"idempotency keys {keys[:5]}... differ from the expected {list(self.keys)[:5]}")
