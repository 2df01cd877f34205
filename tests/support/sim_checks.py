"""The state machine simulation's checks of transitions (tests/sim/test_simulation.py): every
task transition against the one table of legal moves (broker/core/transitions.py), the
independent model of task trees, code readiness and idempotency keys.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

import msgspec

from broker.core import (
    IDEMPOTENCY_MIN_RETENTION_MS,
    ApplyResult,
    Artifact,
    CancelCount,
    ErrorCode,
    Rejected,
    ReplayedResults,
    Task,
    TaskRef,
    Tenant,
    TransactionDone,
    TransactionRef,
    TreeState,
    WorkerReconciled,
    idempotency_scope,
    tree_value,
)
from broker.core import entries as e
from broker.core.transitions import EDGES
from tests.support.sim_common import encode_result, fail
from tests.support.sim_model import (
    CANCELLED,
    DELAYED,
    ERROR,
    FINAL,
    FINISHED,
    LIVE,
    LOST,
    PENDING,
    RUNNING,
    SPAWN_REFUSED_RE,
    WAITING,
    Event,
    TracedMachine,
)

# --- checks ------------------------------------------------------------------------------

# The legal transitions and the entry types each may happen in are the one table in
# broker/core/transitions.py: EDGES, (old, new) -> Edge, None as old/new: created/deleted.

RESULT_TYPES: Final[dict[type, tuple[type, ...]]] = {
    e.CancelTask: (TaskRef, Rejected),
    e.CancelTasks: (CancelCount, Rejected),
    e.BeginTransaction: (TransactionRef, Rejected),
    e.CommitTransaction: (TransactionDone, Rejected),
    e.RollbackTransaction: (TransactionDone, Rejected),
    e.SetTenant: (Tenant, Rejected),
    e.SetConfig: (type(None), Rejected),
    e.Tick: (type(None),),
    e.RegisterWorker: (WorkerReconciled, Rejected),
    e.AddCode: (Artifact, Rejected),
    e.CodeReady: (Artifact, Rejected),
    e.DeleteCode: (Artifact, Rejected),
    e.WorkerDead: (type(None), Rejected),
    e.WorkerSilent: (type(None),),
    e.WorkerDisconnected: (type(None),),
    e.SetWebhook: (Tenant, Rejected),
    e.WebhookProgress: (type(None),),
}


@dataclass(slots=True)
class Pre:
    """What the checks need to know about the state just before an entry."""

    txn_tasks: list[int] | None = None
    worker_running: frozenset[int] = frozenset()
    open_txns: frozenset[int] = frozenset()
    retention_ms: int = 0  # purge timers fire before the entry's own change of it
    # RegisterWorker: the (task, attempt) pairs the state has running on that worker.
    reported: frozenset[tuple[int, int]] = frozenset()
    # SubmitTasks: no task of any tenant was waiting (placements in it may start).
    idle: bool = False
    # WorkerDisconnected: the named workers' states, and their running tasks' lost counts.
    worker_states: dict[str, str] = field(default_factory=dict)
    running_lost: dict[int, int] = field(default_factory=dict)


class TransitionChecks:
    """Independent checks on the primary replica: its transitions, task trees, code
    readiness and idempotency keys (tests/support/sim_checker.py adds the results and
    the full scan)."""

    def __init__(self, machine: TracedMachine) -> None:
        self.m = machine
        self.mirror: dict[int, str] = {}  # task id -> state, from the transitions alone
        self.attempts: dict[int, int] = {}
        # Attempts lost with their worker, by task (docs/DESIGN.md §6, "Lost workers").
        self.lost: dict[int, int] = {}
        self.tenant_of: dict[int, str] = {}
        self.queues: dict[str, dict[int, None]] = {}  # expected FIFO waiting queues
        # Code readiness as the entries say (sha -> ready), and the waiting tasks expected
        # outside the queues because their code is not ready (sha -> task ids).
        self.code_ready: dict[str, bool] = {}
        self.parked: dict[str, set[int]] = {}
        self.code_of: dict[int, str | None] = {}
        self.last_new_id = 0
        self.txn_members: dict[int, set[int]] = {}  # txn id -> ids submitted into it
        # Idempotency keys the state must remember, oldest first: key -> (first use ms,
        # the first submission's results, encoded).
        # (scope, key) -> (first use, first result): keys are per tenant.
        self.keys: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.stats: Counter[str] = Counter()
        self.last_events: list[Event] = []
        # The independent model of task trees, from the transitions alone: each tracked
        # root's live tasks in its current run, status, run number and deadline.
        self.tree_live: dict[int, set[int]] = {}
        self.tree_status: dict[int, str] = {}
        self.started: set[tuple[int, int]] = set()  # (task, attempt) sent to a worker
        self.tree_attempt: dict[int, int] = {}
        self.tree_timeout: dict[int, int] = {}
        self.tree_deadline: dict[int, int] = {}  # pending trees only
        self.tree_size: dict[int, int] = {}  # tasks created in the current run
        # Dependencies: the unfinished ones each live task waits for (blocked while any is
        # left: in no queue), and the dependants of each, in the order they began to wait.
        self.waits: dict[int, set[int]] = {}
        self.dependants_of: dict[int, dict[int, None]] = {}

    # --- before / after each entry --------------------------------------------------

    def before(self, entry: e.Entry) -> Pre:
        m = self.m
        pre = Pre(
            open_txns=frozenset(m.transactions),
            retention_ms=m.config.finished_task_retention_ms,
        )
        if isinstance(entry, e.CommitTransaction | e.RollbackTransaction):
            txn = m.transactions.get(entry.transaction_id)
            if txn is not None:
                pre.txn_tasks = list(txn.task_ids)
        elif isinstance(entry, e.SubmitTasks):
            pre.idle = not any(m.waiting.values())
        elif isinstance(entry, e.WorkerDisconnected):
            for closed in entry.workers:
                worker = m.workers.get(closed.worker_id)
                if worker is not None:
                    pre.worker_states[worker.id] = worker.state
                    for tid in m.running_by_worker.get(worker.id, ()):
                        pre.running_lost[tid] = m.tasks[tid].lost
        elif isinstance(entry, e.WorkerDead | e.RegisterWorker):
            pre.worker_running = frozenset(m.running_by_worker.get(entry.worker_id, ()))
            pre.reported = frozenset((tid, m.tasks[tid].attempt) for tid in pre.worker_running)
        return pre

    # --- transitions ------------------------------------------------------------------------

    def _check_events(self, entry: e.Entry, events: list[Event], pre: Pre) -> None:
        m = self.m
        kind = type(entry)
        now = m.now_ms
        for ev in events:
            tid, old, new, task = ev.task_id, ev.old, ev.new, ev.task
            self.stats[f"transition {old}->{new}"] += 1
            if (old, new) not in EDGES:
                fail(f"task {tid}: illegal transition {old} -> {new} in {kind.__name__}")
            allowed = EDGES[(old, new)].entries
            if allowed is not None and kind not in allowed:
                fail(f"task {tid}: transition {old} -> {new} in a {kind.__name__} entry")
            if old is None:
                if tid in self.mirror or tid <= self.last_new_id:
                    fail(f"task id {tid} created again or out of order (last {self.last_new_id})")
                self.last_new_id = tid
                if ev.attempt != 0:
                    fail(f"new task {tid} has attempt {ev.attempt}")
                self.tenant_of[tid] = task.tenant
                self.code_of[tid] = task.code
                self.attempts[tid] = 0
                self.lost[tid] = 0
            else:
                if self.mirror.get(tid) != old:
                    fail(f"task {tid} left {old} but the trace had it {self.mirror.get(tid)}")
                previous = self.attempts[tid]
                expected = previous + 1 if (old, new) == (WAITING, RUNNING) else previous
                if ev.attempt != expected:
                    fail(f"task {tid} {old}->{new}: attempt {ev.attempt}, expected {expected}")
                if ev.attempt - task.released - task.lost > task.max_attempts:
                    fail(f"task {tid} attempt {ev.attempt} > max_attempts {task.max_attempts}")

            # Rules that depend on why the transition happened.
            # (Events hold the task itself: a later change in the entry, e.g. a cancel
            # of the replayed root, shows through.)
            replayed = task.root == tid and (
                (task.error or "").endswith("; replayed") or task.state != new
            )
            if (
                old == RUNNING
                and (new == WAITING or (new == ERROR and not self._deadline_error(task, now)))
                and not replayed
                and self._lost(entry, tid, pre)
            ):
                # Lost with its worker: counted apart, and it retries at once or fails.
                self.lost[tid] += 1
                self.stats["attempt lost with its worker"] += 1
            if new == CANCELLED:
                if task.root is not None and (task.error or "").startswith("tree of task"):
                    self.stats["tree task cancelled"] += 1
                elif isinstance(entry, e.CancelTasks):
                    if tid not in entry.task_ids or entry.tenant not in (None, task.tenant):
                        fail(f"task {tid} cancelled by a batch not naming it (or its tenant)")
                elif not isinstance(entry, e.CancelTask) or tid != entry.task_id:
                    fail(f"task {tid} cancelled in {kind.__name__} (error {task.error!r})")
            elif new == RUNNING:
                assert isinstance(entry, e.AssignTasks | e.SubmitTasks)
                if (tid, task.worker) not in {(a.task_id, a.worker_id) for a in entry.assignments}:
                    fail(f"task {tid} started without an assignment")
                if isinstance(entry, e.SubmitTasks):
                    self.stats["task placed by its submit"] += 1
                    if not pre.idle or old != WAITING or tid not in self.created_now(entry):
                        fail(f"task {tid} placed by a submit that did not create it, or late")
                code = self.code_of[tid]
                # Unknown: deleted since (a replayed tree task), not blocked by the state.
                if code is not None and not self.code_ready.get(code, True):
                    fail(f"task {tid} started though its code {code} is not ready")
            elif old == PENDING and new in (WAITING, DELAYED):
                if pre.txn_tasks is None or tid not in pre.txn_tasks:
                    fail(f"task {tid} left pending by a commit of another transaction")
                if new == DELAYED and not (task.start_after_ms or 0) > now:
                    fail(f"task {tid} committed as delayed though start_after has passed")
                if new == WAITING and (task.start_after_ms or 0) > now:
                    fail(f"task {tid} committed as waiting before its start_after")
            elif (old, new) == (DELAYED, WAITING):
                if task.start_after_ms is None or task.start_after_ms > now:
                    fail(f"task {tid} started before its start_after {task.start_after_ms}")
            elif (old, new) == (FINISHED, WAITING):
                if not replayed:
                    fail(f"task {tid} finished then waiting, not a replayed root")
            elif (old, new) == (RUNNING, DELAYED):
                counted = ev.attempt - task.released - task.lost
                if (
                    not self._attempt_over(entry, tid, pre)
                    or counted >= task.max_attempts
                    or self._lost(entry, tid, pre)
                ):
                    fail(f"task {tid} delayed in {kind.__name__} without a failed attempt")
                # The retry is due retry_backoff * 2^(n-1), capped, +-25% from now.
                retry = task.counted_attempts()
                nominal = min(task.retry_backoff_ms << (retry - 1), task.retry_backoff_max_ms)
                delay = (task.start_after_ms or 0) - now
                if not (nominal * 3 // 4 <= delay <= nominal * 5 // 4 and delay > 0):
                    fail(f"task {tid} retry {retry} delayed {delay} ms, nominal {nominal}")
            elif old == RUNNING and new == WAITING:
                if not replayed and not self._attempt_over(entry, tid, pre):
                    fail(f"task {tid} back to waiting in {kind.__name__} without a reason")
                if self._given_back(entry, task):
                    # Not counted (docs/DESIGN.md §6): it may run again whatever its attempt.
                    self.stats["lost assignment given back"] += task.error == LOST
                elif self._lost(entry, tid, pre):
                    if task.lost > task.max_lost:
                        fail(f"task {tid} retried after losing {task.lost} > {task.max_lost}")
                elif ev.attempt - task.released - task.lost >= task.max_attempts:
                    fail(f"task {tid} retried after its last attempt {ev.attempt}")
            elif new == ERROR and self._dependency_error(task):
                self.stats["dependant failed with its dependency"] += 1
            elif new == ERROR and not self._deadline_error(task, now):
                if old != RUNNING or not self._attempt_over(entry, tid, pre):
                    fail(f"task {tid} {old}->error without a reason: {task.error!r}")
                if self._lost(entry, tid, pre):
                    self.stats["task failed past its max_lost"] += 1
                    ending = f"(lost {task.lost} times, max_lost {task.max_lost})"
                    if task.lost <= task.max_lost or not (task.error or "").endswith(ending):
                        fail(f"task {tid} failed losing {task.lost}: {task.error!r}")
                elif ev.attempt - task.released - task.lost < task.max_attempts:
                    fail(f"task {tid} failed at attempt {ev.attempt} of {task.max_attempts}")
                if not task.error:
                    fail(f"task {tid} failed without an error message")
            if (
                new is None
                and old in FINAL
                and (task.finished_ms is None or task.finished_ms + pre.retention_ms > now)
            ):
                fail(f"task {tid} purged early: finished {task.finished_ms}, now {now}")
            if new is None and old == PENDING:
                txn_id = task.transaction
                if txn_id is None or txn_id in m.transactions:
                    fail(f"pending task {tid} deleted while transaction {txn_id} is open")
            # Mirror and expected FIFO queues.
            tenant = self.tenant_of[tid]
            code = self.code_of[tid]
            blocked = code is not None and not self.code_ready.get(code, True)
            # Blocked by dependencies (before and after this move): in no queue.
            waited = tid in self.waits
            self._track_dependencies(tid, old, new, task)
            waits = tid in self.waits
            if old == WAITING and waited:
                pass
            elif old == WAITING:
                if blocked:
                    assert code is not None
                    self.parked[code].remove(tid)
                else:
                    queue = self.queues.get(tenant, {})
                    if tid not in queue:
                        fail(f"task {tid} left waiting but was not queued")
                    del queue[tid]
            if new == WAITING and not waits:
                self._enqueue(tid)
            if new == FINISHED:
                # Its dependants that waited only for it join the queues, in order.
                for dependant in self.dependants_of.pop(tid, {}):
                    left = self.waits[dependant]
                    left.discard(tid)
                    if not left:
                        del self.waits[dependant]
                        if self.mirror.get(dependant) == WAITING:
                            self._enqueue(dependant)
                            self.stats["task released by its dependencies"] += 1
            elif new in (ERROR, CANCELLED):
                self.dependants_of.pop(tid, None)  # failed with it, or by their tree
            if new is None:
                del self.mirror[tid]
                del self.attempts[tid]
                del self.tenant_of[tid]
                del self.code_of[tid]
            else:
                self.mirror[tid] = new
                self.attempts[tid] = ev.attempt

    def _enqueue(self, tid: int) -> None:
        code = self.code_of[tid]
        if code is not None and not self.code_ready.get(code, True):
            self.parked.setdefault(code, set()).add(tid)
            self.stats["task parked on code"] += 1
            return
        queue = self.queues.setdefault(self.tenant_of[tid], {})
        if tid in queue:
            fail(f"task {tid} queued twice")
        queue[tid] = None

    def _track_dependencies(self, tid: int, old: str | None, new: str | None, task: Task) -> None:
        """A created task waits for its unfinished dependencies (as the trace has them); a
        task that ends or is deleted waits no more."""
        if old is None:
            waits = [d for d in task.after if self.mirror.get(d) != FINISHED]
            if waits:
                self.waits[tid] = set(waits)
                self.stats["task blocked by dependencies"] += 1
                for dependency in waits:
                    self.dependants_of.setdefault(dependency, {})[tid] = None
        elif new in FINAL or new is None:
            for dependency in self.waits.pop(tid, ()):
                self.dependants_of.get(dependency, {}).pop(tid, None)

    def _dependency_error(self, task: Task) -> bool:
        """Whether the task failed because a dependency of it failed or was cancelled."""
        words = (task.error or "").split()
        if len(words) < 3 or words[0] != "dependency" or not words[1].isdigit():
            return False
        dependency = self.m.tasks.get(int(words[1]))
        if int(words[1]) not in task.after or dependency is None:
            fail(f"task {task.id} failed with {task.error!r}, not one of its dependencies")
        elif dependency.state not in (ERROR, CANCELLED):
            fail(f"task {task.id} failed with {task.error!r} but it is {dependency.state}")
        return True

    @staticmethod
    def created_now(entry: e.SubmitTasks) -> set[int]:
        return {spec.id for spec in entry.tasks}

    def check_placements(self, entry: e.Entry) -> None:
        """Tasks a submit started fit their workers as the scheduler counts: within the
        pool's capacity, the worker's resources and tenants, the tenant's max_running."""
        if not isinstance(entry, e.SubmitTasks):
            return
        m = self.m
        for ev in self.last_events:
            if ev.new != RUNNING:
                continue
            task = ev.task
            worker = m.workers[task.worker or ""]
            types = worker.task_types
            pool = task.type if task.type in types else "*"
            running = [m.tasks[i] for i in m.running_by_worker[worker.id]]
            in_pool = [t for t in running if (t.type if t.type in types else "*") == pool]
            if len(in_pool) > types.get(pool, 0):
                fail(f"task {task.id} placed on {worker.id} beyond its {pool!r} capacity")
            for name, amount in task.resources.items():
                used = sum(t.resources.get(name, 0.0) for t in running)
                if amount > 0 and used > worker.resources.get(name, 0.0) + 1e-9:
                    fail(f"task {task.id} placed on {worker.id} beyond its {name!r}")
            if worker.tenants and task.tenant not in worker.tenants:
                fail(f"task {task.id} placed on {worker.id}, which does not serve its tenant")
            limits = m.tenants.get(task.tenant)
            running_now = m.tenant_counts[task.tenant][RUNNING]
            if limits is not None and 0 < limits.max_running < running_now:
                fail(f"task {task.id} placed beyond its tenant's max_running")

    def _check_trees(self, entry: e.Entry, result: ApplyResult, events: list[Event]) -> None:
        """A root completes exactly when the last task of its tree finished, fails at
        once when one ends otherwise or its deadline passes, and is then replayed."""
        m = self.m
        now = m.now_ms
        failing = {r for r, due in self.tree_deadline.items() if due <= now}  # timed out
        finished_in: set[int] = set()
        restarted: set[int] = set()
        touched: set[int] = set()
        # Parents that finished but whose anchored children were not all created (refused,
        # or anchored outside the tree): their tree fails with that finish.
        spawn_failed: set[int] = set()
        if isinstance(entry, e.FinishTasks) and isinstance(result, list):
            created = {ev.task_id for ev in events if ev.old is None}
            for o, item in zip(entry.outcomes, result, strict=True):
                parent = m.tasks.get(o.task_id)
                accepted = isinstance(item, TaskRef)
                tracked = parent is not None and parent.root is not None
                if (
                    o.ok
                    and accepted
                    and tracked
                    and any(s.anchors and s.task.id not in created for s in o.spawn)
                ):
                    spawn_failed.add(o.task_id)
                    self.stats["tree spawn refused"] += 1
        for ev in events:
            tid, old, new, task = ev.task_id, ev.old, ev.new, ev.task
            root = task.root
            if root is None or (root not in self.tree_live and tid != root):
                continue  # untracked, or a leftover of a tree whose root was purged
            touched.add(root)
            if old is None:
                if tid == root:
                    specs = self._specs(entry)
                    self.tree_live[root] = {root}
                    self.tree_status[root] = TreeState.PENDING.value
                    self.tree_attempt[root] = 1
                    self.tree_timeout[root] = specs[root].tree_timeout_ms
                    self.tree_size[root] = 1
                else:
                    if self.tree_status.get(root) != TreeState.PENDING:
                        fail(f"task {tid} created in tree {root} that is not pending")
                    self.tree_live[root].add(tid)
                    self.tree_size[root] += 1
                    self.stats["max tree size"] = max(
                        self.stats["max tree size"], self.tree_size[root]
                    )
            elif new is None:
                if tid == root:
                    for model in (self.tree_live, self.tree_status, self.tree_attempt):
                        del model[root]
                    self.tree_deadline.pop(root, None)
                    failing.discard(root)
                    touched.discard(root)
            elif old in LIVE and new in FINAL:
                self.tree_live[root].discard(tid)
                if self.tree_status[root] == TreeState.PENDING and root not in failing:
                    if new != FINISHED or tid in spawn_failed:
                        failing.add(root)
                    else:
                        finished_in.add(root)
            elif (old, new) == (WAITING, RUNNING) and tid == root:
                # The tree's timeout runs from the root's first start in each run.
                if root in failing:
                    restarted.add(root)  # replayed by a timer of this entry, runs again
                else:
                    self.tree_deadline.setdefault(root, now + self.tree_timeout[root])
            elif old in FINAL and new in LIVE:
                if tid != root or root not in failing:
                    fail(f"task {tid} of tree {root} live again without a replay")
                self.tree_live[root].add(tid)
        completed = {
            root
            for root in finished_in - failing
            if root in self.tree_live and not self.tree_live[root]
        }
        for root in sorted(completed | failing | touched):
            tree = m.trees.get(root)
            if tree is None:
                fail(f"tracked root {root} has no tree record")
            live = self.tree_live[root]
            if root in completed:
                if tree.state != TreeState.COMPLETED or tree.ack_val != 0:
                    fail(f"tree {root}: its last task finished, yet it is {tree.state}")
                self.stats["tree completed"] += 1
            elif root in failing:
                if tree.state == TreeState.FAILED:
                    if live:
                        fail(f"tree {root} failed, yet tasks {sorted(live)} live")
                    self.stats["tree failed"] += 1
                elif tree.state == TreeState.PENDING:
                    if tree.attempt != self.tree_attempt[root] + 1 or live != {root}:
                        fail(f"tree {root} replayed as run {tree.attempt}, live {sorted(live)}")
                    self.tree_attempt[root] += 1
                    self.tree_size[root] = 1
                    self.stats["tree replayed"] += 1
                else:
                    fail(f"tree {root} completed though one of its tasks failed")
                self.tree_deadline.pop(root, None)  # the next run starts with the root
                if root in restarted and tree.state == TreeState.PENDING:
                    self.tree_deadline[root] = now + self.tree_timeout[root]
            if tree.state != TreeState.PENDING:
                self.tree_status[root] = tree.state
                self.tree_deadline.pop(root, None)
                continue
            if not live or root in completed:
                fail(f"tree {root} pending with no live task (completed early or late)")
            if tree.attempt != self.tree_attempt[root]:
                fail(f"tree {root} at run {tree.attempt}, expected {self.tree_attempt[root]}")
            if tree.deadline_ms != self.tree_deadline.get(root):
                fail(f"tree {root} deadline {tree.deadline_ms}, not {self.tree_deadline.get(root)}")
            acked = 0
            for tid in live:
                acked ^= tree_value(tid)
            if tree.ack_val != acked:
                fail(f"tree {root} ack val differs from its live tasks' {sorted(live)[:8]}")

    def _tree_kept(self, root: int, now: int) -> bool:
        tree = self.m.trees.get(root)
        ended = tree.ended_ms if tree is not None else None
        return ended is not None and ended + self.m.config.finished_task_retention_ms > now

    @staticmethod
    def _specs(entry: e.Entry) -> dict[int, e.TaskSpec]:
        """The specs of an entry by id; the first wins (a reused id is refused)."""
        specs: list[e.TaskSpec] = []
        if isinstance(entry, e.SubmitTasks):
            specs = list(entry.tasks)
        elif isinstance(entry, e.FinishTasks):
            specs = [s.task for o in entry.outcomes for s in o.spawn]
        return {spec.id: spec for spec in reversed(specs)}

    def _track_code(self, entry: e.Entry, result: ApplyResult) -> None:
        """Follow code readiness; a readied artifact's parked tasks join their queues."""
        if isinstance(result, Rejected):
            return
        released: str | None = None
        if isinstance(entry, e.DeleteCode):
            if self.parked.pop(entry.sha256, None):  # (a set emptied by moves may stay)
                fail(f"artifact {entry.sha256} deleted with tasks parked on it")
            self.code_ready.pop(entry.sha256, None)
            self.stats["code deleted"] += 1
            return
        if isinstance(entry, e.AddCode):
            if entry.sha256 not in self.code_ready:
                self.code_ready[entry.sha256] = entry.ready
            elif entry.ready and not self.code_ready[entry.sha256]:
                released = entry.sha256
        elif isinstance(entry, e.CodeReady) and not self.code_ready[entry.sha256]:
            released = entry.sha256
        if released is None:
            return
        self.code_ready[released] = True
        # In id order, after everything queued so far.
        for tid in sorted(self.parked.pop(released, set())):
            self.queues.setdefault(self.tenant_of[tid], {})[tid] = None
            self.stats["task released by code ready"] += 1

    def _attempt_over(self, entry: e.Entry, tid: int, pre: Pre) -> bool:
        """Whether this entry ends the running attempt of task ``tid`` (failure, death, or
        a finish whose children do not fit in their tenant's max_waiting)."""
        if isinstance(entry, e.FinishTasks):
            return any(
                o.task_id == tid and (not o.ok or self._spawn_refused(o)) for o in entry.outcomes
            )
        if isinstance(entry, e.RegisterWorker):
            # Lost: the state had it running there and the worker did not report that attempt.
            attempt = dict(pre.reported).get(tid)
            return attempt is not None and e.TaskAttempt(tid, attempt) not in entry.running
        return isinstance(entry, e.WorkerDead) and tid in pre.worker_running

    def _lost(self, entry: e.Entry, tid: int, pre: Pre) -> bool:
        """Whether this entry ends the running attempt of ``tid`` as lost with its worker:
        not counted against max_attempts, bounded by max_lost (a death or return logged
        in format 5; an older one counts it as a failure)."""
        return (
            isinstance(entry, e.WorkerDead | e.RegisterWorker)
            and entry.v >= e.LOST_ATTEMPTS_VERSION
            and self._attempt_over(entry, tid, pre)
        )

    @staticmethod
    def _given_back(entry: e.Entry, task: Task) -> bool:
        """Whether this entry gave the running attempt of ``task`` back (not counted), and
        nothing else (a tree's timeout due at its time) ended it first."""
        return isinstance(entry, e.FinishTasks) and any(
            o.task_id == task.id and o.released and not o.ok and task.error == o.error
            for o in entry.outcomes
        )

    def _spawn_refused(self, outcome: e.TaskOutcome) -> bool:
        """Whether this ok outcome's spawn was refused, rightly: its error names a tenant
        of its children and that tenant's max_waiting, and none of them was created."""
        task = self.m.tasks.get(outcome.task_id)
        found = SPAWN_REFUSED_RE.match(task.error or "") if task is not None else None
        if not outcome.ok or not outcome.spawn:
            return False
        if found is None and task is not None and task.state == CANCELLED:
            # Its tree failed later in the same entry: that error replaced the refusal's.
            self.stats["spawn refused, then its tree failed"] += 1
            return (task.error or "").startswith("tree of task") and not any(
                s.task.id in self.m.tasks for s in outcome.spawn
            )
        if found is None:
            return False
        name, limit = found.group(1), int(found.group(2))
        tenant = self.m.tenants.get(name)
        if tenant is None or tenant.max_waiting != limit or limit <= 0:
            fail(f"task {outcome.task_id} refused a spawn under no such limit: {task!r}")
        if name not in {s.task.tenant for s in outcome.spawn}:
            fail(f"task {outcome.task_id}'s spawn refused for a tenant of none of its children")
        if any(s.task.id in self.m.tasks for s in outcome.spawn):
            fail(f"task {outcome.task_id}'s spawn was refused, yet some children exist")
        self.stats["spawn refused max_waiting"] += 1
        return True

    @staticmethod
    def _deadline_error(task: Task, now: int) -> bool:
        return (
            task.deadline_ms is not None
            and task.deadline_ms <= now
            and task.error == "deadline exceeded"
        )

    # --- idempotency keys --------------------------------------------------------------------

    def _check_idempotency(
        self, entry: e.Entry, result: ApplyResult, events: list[Event], pre: Pre
    ) -> None:
        """A remembered key never creates tasks again and replays the first result."""
        now = self.m.now_ms
        # Keys expire when the clock advances, under the retention before this entry.
        retention_ms = max(pre.retention_ms, IDEMPOTENCY_MIN_RETENTION_MS)
        while self.keys:
            oldest, (first_ms, _) = next(iter(self.keys.items()))
            if first_ms + retention_ms > now:
                break
            del self.keys[oldest]
            self.stats["idempotency key expired"] += 1
        replayed = isinstance(result, ReplayedResults)
        key = entry.idempotency_key if isinstance(entry, e.SubmitTasks) else None
        if key is None:
            if replayed:
                fail(f"a replayed result for an entry without an idempotency key: {result!r}")
            return
        assert isinstance(result, list)
        scoped = (idempotency_scope(spec.tenant for spec in entry.tasks), key)
        created = [ev.task_id for ev in events if ev.old is None]
        if not (0 < len(key) <= 128 and all(" " <= c <= "~" for c in key)):
            if (
                replayed
                or created
                or not all(isinstance(r, Rejected) and r.code == ErrorCode.INVALID for r in result)
            ):
                fail(f"invalid idempotency key {key!r} not refused as invalid: {result!r}")
            self.stats["SubmitTasks rejected invalid key"] += 1
            return
        remembered = self.keys.get(scoped)
        if remembered is not None:
            if created:
                fail(f"idempotency key {key!r} repeated, yet tasks {created} were created")
            if not replayed or encode_result(result) != remembered[1]:
                first = msgspec.msgpack.decode(remembered[1])
                fail(f"key {key!r} repeated: got {result!r}, first result {first!r}")
            self.stats["SubmitTasks replayed"] += 1
            return
        if replayed:
            fail(f"a replay for idempotency key {key!r}, never remembered or expired")
        if any(isinstance(r, TaskRef) for r in result):
            self.keys[scoped] = (now, encode_result(result))
            self.stats["idempotency key remembered"] += 1

    # --- results ---------------------------------------------------------------------------
