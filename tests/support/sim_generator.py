"""The state machine simulation's entry generator (tests/sim/test_simulation.py): a pure
function of ``random.Random(seed)`` and of the state it reads, producing valid and invalid
entries mixed, with what it expects of each result.
"""

from __future__ import annotations

import functools
import math
import random
from collections import deque
from collections.abc import Callable
from itertools import islice

import msgspec

from broker.core import (
    MAX_TREE_TIMEOUT_MS,
    ErrorCode,
    StateMachine,
    SubmissionRecord,
    Task,
    TreeState,
    WorkerState,
    idempotency_scope,
)
from broker.core import entries as e
from broker.core.backoff import MAX_BACKOFF_MS, MAX_PRIORITY
from broker.core.validation import MAX_LOST_LIMIT
from tests.support.sim_generator_code import CodeEntries
from tests.support.sim_generator_workers import WorkerEntries
from tests.support.sim_model import (
    BAD_KEYS,
    BAD_TENANTS,
    BAD_TYPES,
    CODE_SHAS,
    DELAYED,
    FINAL,
    INVALID,
    NOT_FOUND,
    PENDING,
    RUNNING,
    SLOTS,
    STALE,
    TENANT_WEIGHTS,
    TENANTS,
    TYPES,
    WAITING,
    WORKERS,
    Expect,
    give_back_unreceived,
)

# How far the clock moves: (below this draw of rng.random(), a step from lo to hi ms).
Steps = tuple[tuple[float, int, int], ...]
TWO_DAYS_MS = 2 * 86_400_000
# Between entries: mostly the same millisecond or a few; now and then an idle hour or more.
ENTRY_STEPS: Steps = (
    (0.45, 0, 0),
    (0.85, 1, 200),
    (0.97, 200, 5_000),
    (0.995, 5_000, 120_000),
    (1.0, 3_600_000, TWO_DAYS_MS),
)
# A Tick's step: longer, to reach timers (delays, deadlines, retention).
TICK_STEPS: Steps = (
    (0.1, 0, 0),
    (0.55, 1, 2_000),
    (0.85, 2_000, 60_000),
    (0.97, 60_000, 1_800_000),
    (1.0, 3_600_000, TWO_DAYS_MS),
)


def random_step(rng: random.Random, steps: Steps) -> int:
    """One step drawn from ``steps`` (a zero step draws nothing more from ``rng``)."""
    r = rng.random()
    for below, lo, hi in steps:
        if r < below:
            return rng.randint(lo, hi) if hi else 0
    raise AssertionError(f"rng.random() gave {r}")


class EntryGenerator(CodeEntries, WorkerEntries):
    """Produces entries from ``random.Random(seed)`` and a read-only look at ``view``."""

    def __init__(self, seed: int, view: StateMachine) -> None:
        self.rng = random.Random(seed)
        self.view = view
        self.now_ms = 1_700_000_000_000 + self.rng.randrange(1_000_000)
        self.next_task_id = 0
        self.next_txn_id = 0
        self.recent_ids: deque[int] = deque(maxlen=400)
        self.closed_txns: deque[int] = deque(maxlen=50)
        self.recent_outcomes: deque[e.TaskOutcome] = deque(maxlen=50)
        self.next_key = 0
        self.recent_keys: deque[str] = deque(maxlen=40)  # idempotency keys to repeat
        # The scope (tenants) of each key's first submission: a retry repeats it.
        self.key_scopes: dict[str, str] = {}
        self.scripted: deque[Callable[[], tuple[e.Entry, Expect]]] = deque()
        # Seed-level personality, so that different seeds stress different things.
        self.small_retention = self.rng.random() < 0.5
        self.submit_weight = self.rng.choice((18, 24, 30))
        self.slot_probability = self.rng.choice((0.1, 0.35, 0.6))
        self.tree_probability = self.rng.choice((0.05, 0.15, 0.3))
        # Some seeds grow big trees (hundreds of tasks): sturdier, more prolific children.
        self.big_trees = self.rng.random() < 0.4
        # Tasks submitted with dependencies (``after``): blocked outside the queues.
        self.after_probability = self.rng.choice((0.0, 0.1, 0.3))
        for worker in WORKERS[:3]:
            self.scripted.append(functools.partial(self._register, worker))
        if self.small_retention:
            retention = self.rng.choice((1, 500, 5_000, 60_000))
            self.scripted.append(lambda: self._config(retention))
        kinds: list[tuple[Callable[[], tuple[e.Entry, Expect]], float]] = [
            (self._submit, self.submit_weight),
            (self._assign, 18),
            (self._finish, 16),
            (self._tick, 7),
            (self._cancel, 6),
            (self._cancel_many, 1.5),
            (self._begin, 5),
            (self._commit, 4),
            (self._rollback, 2),
            (self._set_tenant, 3),
            (self._register_random, 3),
            (self._worker_dead, 2),
            (self._worker_silent, 1),
            (self._worker_disconnected, 1),
            (self._config_random, 0.3),
            (self._add_code, 0.5),
            (self._code_ready, 0.3),
            (self._delete_code, 0.3),
            (self._webhook, 1),
        ]
        self.kinds = [k for k, _ in kinds]
        self.kind_weights = [w for _, w in kinds]

    # --- helpers ---------------------------------------------------------------------

    def _time(self) -> int:
        """The next entry's time_ms (the replicated clock never goes back)."""
        rng = self.rng
        if rng.random() < 0.01 and self.view.now_ms == self.now_ms:
            # A (new) leader whose clock is a little behind: apply must not go back.
            return self.now_ms - rng.randint(1, 2_000)
        self.now_ms += random_step(rng, ENTRY_STEPS)
        return self.now_ms

    def _tenant(self) -> str:
        return self.rng.choices(TENANTS, TENANT_WEIGHTS)[0]

    def _open_txns(self) -> list[int]:
        return list(self.view.transactions)

    def _waiting_pick(self) -> int | None:
        queues = [q for _, q in sorted(self.view.waiting.items()) if q]
        if not queues:
            return None
        queue = self.rng.choice(queues)
        head = list(islice(queue, 4))
        return self.rng.choice(head)

    def _running(self) -> list[int]:
        running = sorted(self.view.by_state[RUNNING])
        return running[:32] + running[-32:] if len(running) > 64 else running

    def _connected(self) -> list[str]:
        return [w.id for w in self.view.workers.values() if w.state == WorkerState.CONNECTED]

    def _recent(self) -> int:
        return self.rng.choice(self.recent_ids) if self.recent_ids else 1

    # --- the stream ----------------------------------------------------------------

    def next(self) -> tuple[e.Entry, Expect]:
        if self.scripted:
            return self.scripted.popleft()()
        kind = self.rng.choices(self.kinds, self.kind_weights)[0]
        return kind()

    def _spec(self) -> tuple[e.TaskSpec, bool]:
        """One task spec and whether it is invalid for sure."""
        rng = self.rng
        bad = False
        if rng.random() < 0.03 and self.next_task_id > 0:
            task_id = rng.randint(max(1, self.next_task_id - 50), self.next_task_id)
            bad = True
        elif rng.random() < 0.005:
            task_id = rng.choice((0, -1))
            bad = True
        else:
            self.next_task_id += rng.choice((1, 1, 1, 2, 7))
            task_id = self.next_task_id
            self.recent_ids.append(task_id)
        tenant = self._tenant()
        transaction: int | None = None
        r = rng.random()
        if r < 0.25:
            open_txns = self._open_txns()
            if open_txns:
                transaction = rng.choice(open_txns)
                if rng.random() < 0.85:
                    tenant = self.view.transactions[transaction].tenant
        elif r < 0.29:
            if self.closed_txns and rng.random() < 0.6:
                transaction = rng.choice(self.closed_txns)
            else:
                transaction = self.next_txn_id + rng.randint(1_000, 2_000)
        deadline: int | None = None
        r = rng.random()
        if r < 0.15:
            deadline = self.now_ms + rng.randint(1, 30_000)
        elif r < 0.16:
            deadline = self.now_ms - rng.randint(0, 1_000)
            bad = True
        start_after: int | None = None
        if rng.random() < 0.15:
            start_after = self.now_ms + rng.randint(-1_000, 20_000)
        resources: dict[str, float] = {}
        if rng.random() < 0.25:
            # Ints on purpose: the leader applies the entry object, followers decode it.
            resources = {"cpu": rng.choice((0.5, 1, 2.0)), "mem": rng.randint(1, 4096)}
        spec_type = rng.choice(TYPES)
        slot = rng.choice(SLOTS) if rng.random() < self.slot_probability else None
        max_attempts = rng.randint(1, 3)
        max_lost = rng.choice((0, 1, e.DEFAULT_MAX_LOST, e.DEFAULT_MAX_LOST))
        code = rng.choice(CODE_SHAS) if rng.random() < 0.05 else None
        priority = rng.choice((0, 0, 0, 1, 1, 5, -2))
        backoff_ms = rng.choice((0, 0, 0, 300, 2_000, 20_000))
        backoff_max_ms = rng.choice((3_000, e.DEFAULT_RETRY_BACKOFF_MAX_MS))
        if rng.random() < 0.06:
            bad = True
            variant = rng.randrange(12)
            if variant == 0:
                spec_type = rng.choice(BAD_TYPES)
            elif variant == 1:
                tenant = rng.choice(BAD_TENANTS)
            elif variant == 2:
                max_attempts = rng.choice((0, -1, 1001))
            elif variant == 3:
                resources = {"cpu": rng.choice((-1.0, -0.001, math.nan, math.inf))}
            elif variant == 4:
                resources = {"bad name": 1.0}
            elif variant == 5:
                slot = rng.choice(("", "s" * 257))
            elif variant == 6:
                code = rng.choice(("abc", CODE_SHAS[0].upper(), CODE_SHAS[0] + "0"))
            elif variant == 7:
                resources = {f"r{i}": 1.0 for i in range(33)}
            elif variant == 8:
                priority = rng.choice((-MAX_PRIORITY - 1, MAX_PRIORITY + 1))
            elif variant == 9:
                backoff_ms = rng.choice((-1, MAX_BACKOFF_MS + 1))
            elif variant == 10:
                max_lost = rng.choice((-1, MAX_LOST_LIMIT + 1))
            else:
                spec_type = "x" * 129
        # Dependencies (issue 18): recent ids, so mostly live tasks of any tenant (another
        # tenant's, purged or never created ones are refused), now and then one twice.
        after: tuple[int, ...] = ()
        if rng.random() < self.after_probability and self.recent_ids:
            after = tuple(self._recent() for _ in range(rng.choice((1, 1, 2, 3))))
            if len(set(after)) != len(after):
                bad = True
        spec = e.TaskSpec(
            id=task_id,
            type=spec_type,
            tenant=tenant,
            after=after,
            params=b'{"n": %d}' % rng.randrange(100),
            slot=slot,
            max_attempts=max_attempts,
            max_lost=max_lost,
            deadline_ms=deadline,
            start_after_ms=start_after,
            resources=resources,
            transaction=transaction,
            code=code,
            track_tree=rng.random() < self.tree_probability,
            tree_timeout_ms=rng.choice((2_000, 600_000, 3_600_000, MAX_TREE_TIMEOUT_MS)),
            priority=priority,
            retry_backoff_ms=backoff_ms,
            retry_backoff_max_ms=backoff_max_ms,
        )
        return spec, bad

    def _spawn(self, task: Task) -> tuple[e.Spawn, ...]:
        """Children for a task's successful finish: mostly anchored to it when tracked."""
        rng = self.rng
        view = self.view
        tracked = task.root is not None
        if tracked and self.big_trees:
            count = rng.choice((0, 1, 1, 2, 2, 3))
        elif tracked and rng.random() < 0.8:
            count = rng.choice((0, 1, 1, 2, 2, 3, 4))
        elif rng.random() < 0.08:
            count = 1
        else:
            return ()
        children: list[e.Spawn] = []
        for _ in range(count):
            self.next_task_id += 1
            if rng.random() < 0.2:  # fewer cancels of tree tasks: big trees too
                self.recent_ids.append(self.next_task_id)
            anchors: tuple[int, ...] = (task.id,)
            r = rng.random()
            if r < 0.2 and task.root is not None:
                # A DAG: also hang from another live task of the same tree.
                live = sorted(view.tree_live.get(task.root, ()))
                if live:
                    anchors = (task.id, rng.choice(live[:16]))
            elif r < 0.3:
                anchors = ()  # not tracked
            elif r < 0.302:
                anchors = (self._recent(),)  # mostly outside the tree: fails it
            spec = e.TaskSpec(
                id=self.next_task_id,
                type=rng.choice(TYPES) if rng.random() > 0.002 else rng.choice(BAD_TYPES),
                tenant=task.tenant,
                max_attempts=rng.randint(2 if self.big_trees else 1, 3),
                slot=rng.choice(SLOTS) if rng.random() < 0.005 else None,
                start_after_ms=self.now_ms + rng.randint(1, 3_000) if rng.random() < 0.05 else None,
                deadline_ms=self.now_ms + rng.randint(1, 60_000) if rng.random() < 0.005 else None,
            )
            children.append(e.Spawn(spec, anchors))
        return tuple(children)

    def _idempotency_key(self) -> tuple[str | None, SubmissionRecord | None, bool]:
        """A submission's key (mostly None), the view's record when it repeats a
        remembered key (it may still expire at this entry), and whether it is invalid."""
        rng = self.rng
        r = rng.random()
        if r < 0.25:
            self.next_key += 1
            key = f"key-{self.next_key}"
            self.recent_keys.append(key)
            return key, None, False
        if r < 0.4 and self.recent_keys:
            key = rng.choice(self.recent_keys)
            scope = self.key_scopes.get(key)
            record = self.view.idempotency.get((scope, key)) if scope is not None else None
            return key, record, False
        if r < 0.405:
            return rng.choice(BAD_KEYS), None, True
        return None, None, False

    def _submit(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        n = self.rng.randint(1, 3) if self.rng.random() < 0.6 else self.rng.randint(4, 20)
        key, replay, bad_key = self._idempotency_key()
        if replay is not None and self.rng.random() < 0.8:
            n = len(replay.results)  # a client's retry sends the same tasks again
        expect = Expect()
        specs: list[e.TaskSpec] = []
        for i in range(n):
            spec, bad = self._spec()
            if bad or bad_key:
                expect.reject[i] = INVALID
            specs.append(spec)
        if replay is not None and replay.scope and self.rng.random() < 0.9:
            # A retry: the same tenants (keys are per tenant); otherwise another tenant
            # reusing the key, which must not replay.
            tenants = replay.scope.split(",")
            specs = [
                msgspec.structs.replace(spec, tenant=tenants[i % len(tenants)])
                for i, spec in enumerate(specs)
            ]
            expect = Expect()  # the first submission's results come back, whatever these are
        if key is not None and not bad_key:
            self.key_scopes.setdefault(key, idempotency_scope(spec.tenant for spec in specs))
        # As a leader would (its placements, apply re-checks each), and now and then wrongly.
        placed = self._placements(specs) if self.rng.random() < 0.4 else ()
        entry = e.SubmitTasks(
            time_ms=time_ms, tasks=tuple(specs), idempotency_key=key, assignments=placed
        )
        return entry, expect

    def _placements(self, specs: list[e.TaskSpec]) -> tuple[e.Assignment, ...]:
        rng = self.rng
        connected = self._connected()
        out: list[e.Assignment] = []
        for spec in specs[: rng.randint(1, len(specs))]:
            r = rng.random()
            if r < 0.85 and connected:
                out.append(e.Assignment(spec.id, rng.choice(connected)))
            elif r < 0.95:
                out.append(e.Assignment(spec.id, rng.choice((*WORKERS, "ghost"))))
            else:  # a task of another entry: never started by this one
                out.append(e.Assignment(self._recent(), rng.choice((*WORKERS, "ghost"))))
        if len(out) > 1 and rng.random() < 0.1:
            out.reverse()  # out of order: only a queue's head may start
        return tuple(out)

    def _cancel(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        rng = self.rng
        r = rng.random()
        task_id: int | None = None
        if r < 0.45:
            task_id = self._recent()
        elif r < 0.6:
            task_id = self._waiting_pick()
        elif r < 0.7:
            running = self._running()
            task_id = rng.choice(running) if running else None
        elif r < 0.8:
            pending = [t for txn in self.view.transactions.values() for t in txn.task_ids]
            task_id = rng.choice(pending) if pending else None
        elif r < 0.87:
            delayed = sorted(self.view.by_state[DELAYED])[:64]
            task_id = rng.choice(delayed) if delayed else None
        if task_id is None:
            task_id = rng.choice((0, -5, self.next_task_id + rng.randint(1_000, 2_000)))
        expect = Expect()
        task = self.view.tasks.get(task_id)
        if task is None:
            expect.reject[0] = NOT_FOUND
        elif task.state in FINAL and not self._replayable(task):
            expect.reject[0] = frozenset({ErrorCode.CONFLICT, ErrorCode.NOT_FOUND})
        return e.CancelTask(time_ms=time_ms, task_id=task_id, reason="sim cancel"), expect

    def _cancel_many(self) -> tuple[e.Entry, Expect]:
        """A bulk cancel's batch: live, final, unknown and repeated ids mixed, sometimes
        scoped to a tenant, now and then over the bound."""
        time_ms = self._time()
        rng = self.rng
        view = self.view
        expect = Expect()
        ids: list[int] = []
        for _ in range(rng.randint(1, 24)):
            r = rng.random()
            picked: int | None = None
            if r < 0.4:
                picked = self._waiting_pick()
            elif r < 0.6:
                running = self._running()
                picked = rng.choice(running) if running else None
            elif r < 0.7:
                delayed = sorted(view.by_state[DELAYED])[:64]
                picked = rng.choice(delayed) if delayed else None
            ids.append(picked if picked is not None else self._recent())
        if rng.random() < 0.1:
            ids.append(ids[0])  # the same id twice: the second is skipped
        if rng.random() < 0.02:
            ids = [self._recent() for _ in range(e.MAX_CANCEL_BATCH + 1)]
            expect.reject[0] = INVALID
        tenant = self._tenant() if rng.random() < 0.4 else None
        entry = e.CancelTasks(
            time_ms=time_ms, task_ids=tuple(ids), reason="sim bulk cancel", tenant=tenant
        )
        return entry, expect

    def _replayable(self, task: Task) -> bool:
        """A finished root whose tree is pending: a timer may replay it (live again)."""
        tree = self.view.trees.get(task.id)
        return tree is not None and tree.state == TreeState.PENDING

    def _begin(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        rng = self.rng
        expect = Expect()
        if rng.random() < 0.04 and self.next_txn_id > 0:
            txn_id = rng.randint(1, self.next_txn_id)
            expect.reject[0] = INVALID
        else:
            self.next_txn_id += rng.choice((1, 1, 3))
            txn_id = self.next_txn_id
        tenant = self._tenant()
        if rng.random() < 0.04:
            tenant = rng.choice(BAD_TENANTS)
            expect.reject[0] = INVALID
        r = rng.random()
        if r < 0.04:
            ttl = rng.choice((0, -1, -10_000))
            expect.reject[0] = INVALID
        elif r < 0.84:
            ttl = rng.randint(50, 15_000)
        else:
            ttl = rng.randint(15_000, 600_000)
        if 0 not in expect.reject:
            expect.accept.add(0)
        entry = e.BeginTransaction(
            time_ms=time_ms, transaction_id=txn_id, tenant=tenant, ttl_ms=ttl
        )
        return entry, expect

    def _txn_target(self, time_ms: int) -> tuple[int, Expect]:
        rng = self.rng
        expect = Expect()
        open_txns = self._open_txns()
        if open_txns and rng.random() < 0.75:
            txn_id = rng.choice(open_txns)
            if self.view.transactions[txn_id].expires_ms > max(time_ms, self.view.now_ms):
                expect.accept.add(0)
        elif self.closed_txns and rng.random() < 0.5:
            txn_id = rng.choice(self.closed_txns)
        else:
            txn_id = rng.choice((0, -1, self.next_txn_id + rng.randint(1, 1_000)))
        if txn_id not in self.view.transactions:
            expect.reject[0] = NOT_FOUND
        else:
            self.closed_txns.append(txn_id)
        return txn_id, expect

    def _txn_tenant(self, txn_id: int, expect: Expect) -> str | None:
        """The tenant a commit or rollback names: mostly the owner's, sometimes none (an
        admin), sometimes another tenant's, to whom the transaction is not open."""
        txn = self.view.transactions.get(txn_id)
        r = self.rng.random()
        if txn is None or r < 0.3:
            return None
        if r < 0.9:
            return txn.tenant
        expect.accept.discard(0)
        expect.reject[0] = NOT_FOUND
        return next(t for t in TENANTS if t != txn.tenant)

    def _commit(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        txn_id, expect = self._txn_target(time_ms)
        tenant = self._txn_tenant(txn_id, expect)
        return e.CommitTransaction(time_ms=time_ms, transaction_id=txn_id, tenant=tenant), expect

    def _rollback(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        txn_id, expect = self._txn_target(time_ms)
        tenant = self._txn_tenant(txn_id, expect)
        entry = e.RollbackTransaction(time_ms=time_ms, transaction_id=txn_id, tenant=tenant)
        return entry, expect

    def _set_tenant(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        rng = self.rng
        expect = Expect()
        tenant = self._tenant()
        max_waiting: int | None = None
        max_running: int | None = None
        weight: float | None = None
        if rng.random() < 0.6:
            max_waiting = rng.choice((0, 0, 0, 1, 3, 5, 10, 25, 100))
        if rng.random() < 0.4:
            max_running = rng.choice((0, 1, 2, 5))
        if rng.random() < 0.4:
            weight = rng.choice((0.5, 1.0, 2, 3.5))  # an int on purpose
        if rng.random() < 0.25:
            expect.reject[0] = INVALID
            variant = rng.randrange(4)
            if variant == 0:
                max_waiting = rng.choice((-1, -100))
            elif variant == 1:
                max_running = -1
            elif variant == 2:
                weight = rng.choice((0.0, -1.0, math.nan, math.inf, -math.inf))
            else:
                tenant = rng.choice(BAD_TENANTS)
        else:
            expect.accept.add(0)
        patch = e.TenantLimitsPatch(max_waiting=max_waiting, max_running=max_running, weight=weight)
        return e.SetTenant(time_ms=time_ms, tenant=tenant, limits=patch), expect

    def _webhook(self) -> tuple[e.Entry, Expect]:
        """A tenant's webhook set, removed or rejected, or delivery marks (forward, back,
        or for tenants without one): the state and its digest must agree on every
        replica, across restarts and snapshot loads."""
        time_ms = self._time()
        rng = self.rng
        expect = Expect()
        if rng.random() < 0.6:
            marks = tuple(
                e.WebhookMark(
                    self._tenant(), (rng.randrange(3), rng.randrange(50), rng.randrange(3))
                )
                for _ in range(rng.randrange(1, 4))
            )
            expect.accept.add(0)
            return e.WebhookProgress(time_ms=time_ms, marks=marks), expect
        tenant, url, secret = self._tenant(), rng.choice(("http://h/x", "https://h:8443/y")), "k"
        if rng.random() < 0.2:
            expect.reject[0] = INVALID
            variant = rng.randrange(3)
            if variant == 0:
                url = "ftp://h/x"
            elif variant == 1:
                secret = ""
            else:
                tenant = rng.choice(BAD_TENANTS)
        else:
            expect.accept.add(0)
            if rng.random() < 0.3:
                return e.SetWebhook(time_ms=time_ms, tenant=tenant, url=None), expect
        after = (rng.randrange(3), rng.randrange(50), rng.randrange(3))
        entry = e.SetWebhook(time_ms=time_ms, tenant=tenant, url=url, secret=secret, after=after)
        return entry, expect

    def _config(
        self, retention: int | None, limits: dict[str, float] | None = None
    ) -> tuple[e.Entry, Expect]:
        entry = e.SetConfig(
            time_ms=self._time(), finished_task_retention_ms=retention, global_limits=limits
        )
        return entry, Expect()

    def _config_random(self) -> tuple[e.Entry, Expect]:
        rng = self.rng
        if self.small_retention:
            retention = rng.choice((None, 0, -1, 1, 200, 3_000, 30_000))
        else:
            retention = rng.choice((None, 0, -1, 3_600_000, 86_400_000, 2 * 86_400_000))
        limits: dict[str, float] | None = None
        expect = Expect()
        r = rng.random()
        if r < 0.3:
            choices: tuple[dict[str, float], ...] = ({}, {"licence": 2}, {"licence": 1.5, "gpu": 0})
            limits = rng.choice(choices)  # ints too
        elif r < 0.4:
            limits = rng.choice(({"licence": -1.0}, {"bad name": 1.0}, {"gpu": math.inf}))
            expect.reject[0] = INVALID
        entry, _ = self._config(retention, limits)
        return entry, expect

    def _due_times(self) -> list[int]:
        """Some future times at which timers are due (to hit them exactly)."""
        view = self.view
        now = view.now_ms
        due: list[int] = [t.expires_ms for t in view.transactions.values()]
        for task_id in sorted(view.by_state[DELAYED])[:32]:
            due.append(view.tasks[task_id].start_after_ms or 0)
        for state in (WAITING, RUNNING, PENDING):
            for task_id in sorted(view.by_state[state])[:32]:
                due.append(view.tasks[task_id].deadline_ms or 0)
        retention = view.config.finished_task_retention_ms
        for task_id in list(self.recent_ids)[-32:]:
            task = view.tasks.get(task_id)
            if task is not None and task.finished_ms is not None:
                due.append(task.finished_ms + retention)
        return sorted({t for t in due if t > now})

    def _tick(self) -> tuple[e.Entry, Expect]:
        rng = self.rng
        if rng.random() < 0.25:
            due = self._due_times()
            if due:
                # Exactly at a timer's due time, or just before it.
                self.now_ms = rng.choice(due[:4]) - rng.choice((0, 0, 0, 1))
                return e.Tick(time_ms=self.now_ms), Expect(scan=True)
        self.now_ms += random_step(rng, TICK_STEPS)
        return e.Tick(time_ms=self.now_ms), Expect()

    def _register(self, worker_id: str) -> tuple[e.Entry, Expect]:
        rng = self.rng
        expect = Expect()
        if worker_id:
            expect.accept.add(0)
        else:
            expect.reject[0] = INVALID
        # A reconnecting worker reports the attempts it still runs: most of the
        # state's, sometimes with a wrong attempt, sometimes tasks it never had.
        running: list[e.TaskAttempt] = []
        for task_id in sorted(self.view.running_by_worker.get(worker_id, ())):
            task = self.view.tasks[task_id]
            r = rng.random()
            if r < 0.6:
                running.append(e.TaskAttempt(task_id, task.attempt))
            elif r < 0.7:
                running.append(e.TaskAttempt(task_id, task.attempt + rng.choice((-1, 1))))
        if rng.random() < 0.2:
            running.append(e.TaskAttempt(self._recent(), 1))
        known = self.view.workers.get(worker_id)  # half the time, the same process is back
        same = known.process_id if known is not None and rng.random() < 0.5 else None
        entry = e.RegisterWorker(
            time_ms=self._time(),
            worker_id=worker_id,
            address=f"10.0.0.{len(worker_id)}:7000",
            process_id=same or f"pid-{rng.randrange(1_000_000)}",
            resources={"cpu": self.rng.choice((2, 4.0, 8.0)), "mem": 16384.0},
            task_types=self._task_types(),
            tenants=tuple(self.rng.sample(TENANTS, self.rng.randint(0, 2))),
            running=tuple(running),
            v=self._lost_version(self.view.registration_loses_attempts(worker_id, tuple(running))),
        )
        give_back = give_back_unreceived(self.view, entry)
        if give_back is not None:  # the leader logs it first; the registration follows
            self.scripted.appendleft(lambda: (entry, expect))
            return give_back
        return entry, expect

    def _task_types(self) -> dict[str, int]:
        types = {"*": self.rng.randint(1, 8)}
        if self.rng.random() < 0.3:  # a type with its own pool (even 0)
            types[self.rng.choice(TYPES)] = self.rng.randint(0, 2)
        return types

    def _register_random(self) -> tuple[e.Entry, Expect]:
        worker_id = "" if self.rng.random() < 0.05 else self.rng.choice(WORKERS)
        return self._register(worker_id)

    def _assign(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        rng = self.rng
        expect = Expect()
        view = self.view
        connected = self._connected()
        assignments: list[e.Assignment] = []
        for i in range(rng.randint(1, 8)):
            if rng.random() < 0.05 and connected and view.parked:
                # A waiting task whose code is not ready: must be refused.
                task_id = rng.choice(sorted(rng.choice(sorted(view.parked.items()))[1]))
                worker_id = rng.choice(connected)
                expect.reject[i] = STALE
                assignments.append(e.Assignment(task_id, worker_id))
                continue
            if rng.random() < 0.75 and connected:
                task_id = self._waiting_pick()
                if task_id is None:
                    task_id = self._recent()
                worker_id = rng.choice(connected)
            else:
                r = rng.random()
                if r < 0.5:
                    task_id = self._recent()
                    worker_id = rng.choice(connected) if connected else "w0"
                elif r < 0.75:
                    task_id = self._waiting_pick() or self._recent()
                    worker_id = rng.choice((*WORKERS, "ghost"))
                else:
                    task_id = self.next_task_id + rng.randint(1_000, 2_000)
                    worker_id = rng.choice(connected) if connected else "w0"
            task = view.tasks.get(task_id)
            worker = view.workers.get(worker_id)
            # A running root may be replayed (waiting again) by its tree's timeout, which
            # fires before the assignment is applied: no expectation for it.
            replayable = task is not None and task.root == task.id
            if (
                worker is None
                or worker.state != WorkerState.CONNECTED
                or task is None
                or (task.state not in (WAITING, DELAYED) and not replayable)
            ):
                expect.reject[i] = STALE
            assignments.append(e.Assignment(task_id, worker_id))
        return e.AssignTasks(time_ms=time_ms, assignments=tuple(assignments)), expect

    def _finish(self) -> tuple[e.Entry, Expect]:
        time_ms = self._time()
        rng = self.rng
        expect = Expect()
        view = self.view
        running = self._running()
        outcomes: list[e.TaskOutcome] = []
        for i in range(rng.randint(1, 8)):
            r = rng.random()
            outcome: e.TaskOutcome
            if outcomes and r < 0.08:
                outcome = rng.choice(outcomes)  # duplicate inside one entry
            elif r < 0.2 and self.recent_outcomes:
                outcome = rng.choice(self.recent_outcomes)  # late duplicate
            elif r < 0.85 and running:
                task = view.tasks[rng.choice(running)]
                # Tree tasks fail less, so that trees grow to hundreds of tasks.
                ok = rng.random() < (0.6 if task.root is None else 0.99)
                outcome = e.TaskOutcome(
                    task_id=task.id,
                    worker_id=task.worker or "",
                    attempt=task.attempt,
                    ok=ok,
                    result=b'{"ok": true}' if ok else None,
                    error=None if ok else rng.choice(("boom", None)),
                    spawn=self._spawn(task) if ok or rng.random() < 0.05 else (),
                )
                variant = rng.random()
                if variant < 0.05:
                    outcome = msgspec.structs.replace(outcome, worker_id="w-wrong")
                elif variant < 0.1:
                    outcome = msgspec.structs.replace(outcome, attempt=task.attempt - 1)
                elif variant < 0.12:
                    outcome = msgspec.structs.replace(outcome, attempt=task.attempt + 1)
            else:
                outcome = e.TaskOutcome(
                    task_id=self._recent(), worker_id=rng.choice(WORKERS), attempt=1, ok=True
                )
            task_now = view.tasks.get(outcome.task_id)
            if (
                task_now is None
                or task_now.state != RUNNING
                or task_now.worker != outcome.worker_id
                or task_now.attempt != outcome.attempt
            ):
                expect.reject[i] = STALE
            outcomes.append(outcome)
            self.recent_outcomes.append(outcome)
        return e.FinishTasks(time_ms=time_ms, outcomes=tuple(outcomes)), expect
