"""The chaos soak's parts (tests/chaos/soak.py): its configuration and constants, the fault
weights and the seeded fault draw, the printed fault log, the client threads' load that
records every acknowledged submission, and the result a run returns.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.client import ConnectionFailedError, StewardClient, StewardError, UnavailableError

TASK_MODULE = Path(__file__).with_name("chaos_tasks.py")
TASK_TYPE = "chaos_tasks:record"
# The load mixes tenants and task types (both run the same recording code).
TASK_TYPES = (TASK_TYPE, "chaos_tasks:again")
TENANT = "chaos"
TENANTS = (TENANT, "chaos-b")
FINAL_STATES = frozenset({"finished", "error", "cancelled"})
LIVE_STATES = frozenset({"waiting", "running", "delayed", "pending"})
# A broker restart that fails because ZooKeeper is unreachable is tried again this often.
MAX_START_FAILURES = 5

# Fault kinds and how often each is drawn.
FAULT_WEIGHTS: dict[str, float] = {
    "kill_broker": 3.0,
    "stop_broker": 3.0,
    "kill_worker": 2.0,
    "stop_worker": 2.0,
    "restart_zookeeper": 1.0,
    # Graceful hand-over: SIGTERM of the leader (it steps down, then it is started again).
    "term_leader": 1.0,
    # A follower down long enough that the ledgers after its snapshot are deleted by
    # retention: it downloads a snapshot from a peer when it comes back.
    "kill_follower_long": 0.7,
    # A broker killed while it starts (replaying, joining the election).
    "kill_starting_broker": 0.7,
}
# Only with a pulsar ledger backend: faults of the engine itself (pulsar-lite, or the Apache
# Pulsar standalone's JVM: its broker and bookie together).
PULSAR_FAULT_WEIGHTS: dict[str, float] = {"kill_pulsar": 1.0, "stop_pulsar": 1.0}


#: The soak's ledger backends: the file ledger, pulsar-lite, a real Apache Pulsar standalone.
LEDGERS = ("file", "pulsar", "apache-pulsar")


@dataclass(frozen=True)
class SoakConfig:
    seed: int
    faults: int = 50
    ledgers: str = "file"  # or "pulsar" (pulsar-lite), or "apache-pulsar" (LEDGERS)
    brokers: int = 3
    workers: int = 2
    clients: int = 4
    # Per client thread, between acknowledged submissions: about 6 tasks a second in all
    # (batches, transactions and trees make several), below what two workers run under
    # the faults, so the backlog stays small and the drain short.
    submit_pause_s: float = 1.0
    gap_s: tuple[float, float] = (0.2, 1.8)  # between two faults
    session_timeout_ms: int = 4_000
    # Shorter than ClusterProcesses' default so that frozen workers are declared dead
    # (their tasks re-run with a higher attempt) within the soak.
    heartbeat_timeout_ms: int = 8_000
    worker_slots: int = 4
    max_attempts: int = 10
    task_seconds_max: float = 0.5
    # Small, so that rolls, retention and snapshot downloads happen in every run: a new
    # ledger every 2 s; closed ledgers older than 3.6 s that the kept snapshots (3, one a
    # second) do not need are deleted.
    snapshot_interval_s: float = 1.0
    ledger_roll_age_s: float = 2.0
    ledger_retention_h: float = 0.001
    # The drain may take 3x the time the backlog needs at the measured rate, at least this.
    drain_floor_s: float = 60.0
    settle_timeout_s: float = 90.0
    # An outage (a fault of the leader to the next acknowledged write, nothing else down)
    # may last the session timeout (the old leader's ZooKeeper session must expire) plus
    # this margin: a client stuck on the frozen or dead leader gives up after its request
    # timeout (CLIENT_TIMEOUT_S, 3 s), and the new leader's take-over (fence and recover
    # the old ledger, replay, open a new one) takes up to about 3 s on a loaded machine.
    outage_margin_s: float = 6.0
    # One zombie-worker fault every this many faults (at least one per run).
    zombie_every: int = 25
    cancel_fraction: float = 0.05
    batch_fraction: float = 0.1
    txn_fraction: float = 0.1
    tree_fraction: float = 0.1

    @property
    def on_pulsar(self) -> bool:
        """Whether the ledgers are in a Pulsar engine (either kind) the soak runs and faults."""
        return self.ledgers in ("pulsar", "apache-pulsar")

    def fault_weights(self) -> dict[str, float]:
        extra = PULSAR_FAULT_WEIGHTS if self.on_pulsar else {}
        return {**FAULT_WEIGHTS, **extra}


@dataclass
class FaultLog:
    seed: int
    started: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)

    def note(self, action: str, target: str, pid: int | None, detail: str = "") -> None:
        elapsed_s = time.monotonic() - self.started
        line = (
            f"[chaos {time.strftime('%H:%M:%S')} +{elapsed_s:7.2f}s] {action:<18} "
            f"{target:<10} pid={pid if pid is not None else '-':<8} {detail}"
        ).rstrip()
        self.lines.append(line)
        print(line, flush=True)

    def fault(self, kind: str, target: str, pid: int | None, detail: str = "") -> None:
        self.faults[kind] += 1
        self.note(kind, target, pid, detail)

    def dump(self) -> str:
        return "\n".join(
            [f"fault log (seed {self.seed}, {sum(self.faults.values())} faults):", *self.lines]
        )


CLIENT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Acked:
    key: str
    task_id: int
    params: dict[str, Any]
    at: float  # monotonic
    type: str = TASK_TYPE
    tenant: str = TENANT


class ChaosLoad:
    """Client threads that submit ``chaos_tasks:record`` tasks through the multi-URL client,
    each with its own idempotency key retried until acknowledged (or the load stops)."""

    def __init__(
        self,
        urls: list[str],
        *,
        seed: int,
        code_sha: str,
        effects_path: Path,
        config: SoakConfig,
    ) -> None:
        self.urls = urls
        self.seed = seed
        self.code_sha = code_sha
        self.effects_path = effects_path
        self.config = config
        self.attempted: dict[str, dict[str, Any]] = {}
        self.acked: dict[str, Acked] = {}
        self.retries: Counter[str] = Counter()  # error class -> retried submissions
        self.unexpected: list[str] = []
        self.cancel_requested: set[int] = set()
        self.batches = 0
        self.transactions = 0
        self.trees = 0
        self.txn_unknown: list[list[str]] = []  # keys of transactions with no known outcome
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> ChaosLoad:
        for client_no in range(self.config.clients):
            thread = threading.Thread(
                target=self._client, args=(client_no,), name=f"chaos-load-{client_no}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), f"{thread.name} did not stop within {timeout_s} s"

    def stopping(self) -> bool:
        return self._stop.is_set()

    def dead_threads(self) -> list[str]:
        return [t.name for t in self._threads if not t.is_alive()]

    def acked_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def _client(self, client_no: int) -> None:
        rng = random.Random(f"{self.seed}-load-{client_no}")
        # A frozen broker never answers: a short request timeout moves on to the next one.
        with StewardClient(
            self.urls, timeout_s=CLIENT_TIMEOUT_S, failover_timeout_s=30.0
        ) as client:
            for seq in itertools.count():
                if self._stop.is_set():
                    return
                key = f"chaos-{self.seed}-{client_no}-{seq}"
                tenant = rng.choice(TENANTS)
                shape = rng.random()
                config = self.config
                # A batch, a transaction, a tree root (2 children), or one task.
                parts = (
                    rng.randint(2, 4) if shape < config.batch_fraction + config.txn_fraction else 1
                )
                tree = config.batch_fraction + config.txn_fraction <= shape
                tree = (
                    tree
                    and shape < config.batch_fraction + config.txn_fraction + config.tree_fraction
                )
                tasks = []
                for part in range(parts):
                    task_key = key if parts == 1 else f"{key}-b{part}"
                    params: dict[str, Any] = {
                        "key": task_key,
                        "seconds": round(rng.uniform(0.0, config.task_seconds_max), 3),
                        "effects": str(self.effects_path),
                    }
                    if tree:
                        params.update(children=2, attempts=config.max_attempts)
                    tasks.append((task_key, rng.choice(TASK_TYPES), params))
                with self._lock:
                    for task_key, _, params in tasks:
                        self.attempted[task_key] = params
                if parts > 1 and shape >= config.batch_fraction:
                    acked = self._transaction(client, tenant, tasks)
                else:
                    acked = self._submit(client, key, tenant, tasks, track_tree=tree)
                if acked and rng.random() < self.config.cancel_fraction:
                    self._cancel(client, rng.choice(acked))
                self._stop.wait(self.config.submit_pause_s)

    def _submit(
        self,
        client: StewardClient,
        key: str,
        tenant: str,
        tasks: list[tuple[str, str, dict[str, Any]]],
        *,
        track_tree: bool = False,
    ) -> list[int]:
        """Submit one task or a batch (one log entry) under ``key``, retried until
        acknowledged; the acknowledged ids."""
        # A task may be lost with a killed or paused worker as often as it may fail
        # (max_lost, docs/DESIGN.md §6, "Lost workers"): the soak kills workers often.
        options: dict[str, Any] = {
            "code": self.code_sha,
            "max_attempts": self.config.max_attempts,
            "max_lost": self.config.max_attempts,
        }
        if track_tree:
            options["track_tree"] = True
        while not self._stop.is_set():
            try:
                if len(tasks) == 1:
                    task_key, task_type, params = tasks[0]
                    handle = client.submit(
                        task_type, params, tenant=tenant, idempotency_key=key, **options
                    )
                    ids = [handle.id]
                else:
                    body = [
                        {"type": t, "tenant": tenant, "params": p, **options} for _, t, p in tasks
                    ]
                    answers = client.submit_many(body, idempotency_key=key)
                    refused = [a for a in answers if isinstance(a, StewardError)]
                    if refused:
                        raise refused[0]
                    ids = [a.id for a in answers if not isinstance(a, StewardError)]
            except (UnavailableError, ConnectionFailedError) as exc:
                # Retryable: the same key again (the broker answers a replay if it was
                # applied the first time).
                with self._lock:
                    self.retries[type(exc).__name__] += 1
                continue
            except StewardError as exc:
                with self._lock:
                    self.unexpected.append(f"{key}: {exc!r}")
                return []
            except Exception as exc:  # the client must not leak transport errors
                with self._lock:
                    self.unexpected.append(f"{key}: {exc!r}")
                self._stop.wait(0.5)
                continue
            now = time.monotonic()
            with self._lock:
                for task_id, (task_key, task_type, params) in zip(ids, tasks, strict=True):
                    self.acked[task_key] = Acked(task_key, task_id, params, now, task_type, tenant)
                if len(tasks) > 1:
                    self.batches += 1
                if track_tree:
                    self.trees += 1
            return ids
        return []

    def _retrying(self, call: Any) -> Any:
        """``call()`` until it answers or fails for good (a StewardError other than
        unavailable); None when the load stops first."""
        while not self._stop.is_set():
            try:
                return call()
            except (UnavailableError, ConnectionFailedError) as exc:
                with self._lock:
                    self.retries[type(exc).__name__] += 1
        return None

    def _transaction(
        self, client: StewardClient, tenant: str, tasks: list[tuple[str, str, dict[str, Any]]]
    ) -> list[int]:
        """Begin, submit each task into it (idempotency keys), commit. Acknowledged only
        once the commit is; an outcome that is not known is recorded for the
        all-or-nothing check (rolled back or expired: none of its tasks exists)."""
        keys = [task_key for task_key, _, _ in tasks]
        try:
            txn = self._retrying(lambda: client.begin(tenant=tenant, ttl_s=30.0))
            if txn is None:
                return []
            ids = []
            for task_key, task_type, params in tasks:
                handle = self._retrying(
                    lambda k=task_key, t=task_type, p=params: client.submit(
                        t,
                        p,
                        tenant=tenant,
                        idempotency_key=k,
                        code=self.code_sha,
                        max_attempts=self.config.max_attempts,
                        max_lost=self.config.max_attempts,
                        transaction=txn,
                    )
                )
                if handle is None:
                    break
                ids.append(handle.id)
            committed = len(ids) == len(tasks) and self._commit(client, txn, ids[0])
        except StewardError:
            committed = False  # e.g. the transaction expired during an outage
        with self._lock:
            if not committed:
                self.txn_unknown.append(keys)
                return []
            now = time.monotonic()
            for task_id, (task_key, task_type, params) in zip(ids, tasks, strict=True):
                self.acked[task_key] = Acked(task_key, task_id, params, now, task_type, tenant)
            self.transactions += 1
        return ids

    def _commit(self, client: StewardClient, txn: int, first: int) -> bool:
        try:
            return self._retrying(lambda: client.commit(txn)) is not None
        except StewardError:
            # A retried commit whose first try was applied: its tasks left ``pending``.
            task = self._retrying(lambda: client.task(first))
            return task is not None and task["state"] != "pending"

    def _cancel(self, client: StewardClient, task_id: int) -> None:
        """Ask to cancel a task (recorded first: the task may end cancelled even when the
        answer is lost)."""
        with self._lock:
            self.cancel_requested.add(task_id)
        while not self._stop.is_set():
            try:
                client.cancel(task_id)
                return
            except (UnavailableError, ConnectionFailedError):
                continue
            except StewardError:
                return  # e.g. already final: a cancel of a final task is refused
            except Exception as exc:
                with self._lock:
                    self.unexpected.append(f"cancel {task_id}: {exc!r}")
                return

    def ack_times(self) -> list[float]:
        with self._lock:
            return sorted(a.at for a in self.acked.values())


@dataclass(frozen=True)
class FaultDraw:
    """One step of the schedule. Every step draws the same values in the same order,
    whatever the cluster's state, so a seed always gives the same sequence of draws;
    whether and where a drawn fault lands depends on the state at that moment."""

    kind: str
    gap_s: float  # wait before it
    leader: bool  # brokers: prefer the leader
    index: int  # which candidate target
    allow: float  # compared with thresholds: may a second (third) one go down
    duration: float  # in [0, 1), scaled per kind
    variant: float  # long or short pause, crash or clean stop, same or new worker id

    @classmethod
    def draw(cls, rng: random.Random, config: SoakConfig) -> FaultDraw:
        weights = config.fault_weights()
        kinds = list(weights)
        return cls(
            kind=rng.choices(kinds, weights=[weights[k] for k in kinds])[0],
            gap_s=rng.uniform(*config.gap_s),
            leader=rng.random() < 0.5,
            index=rng.randrange(1_000_000),
            allow=rng.random(),
            duration=rng.random(),
            variant=rng.random(),
        )


@dataclass(order=True)
class _Recovery:
    due: float
    seq: int
    kind: str = field(compare=False)
    target: str = field(compare=False)


@dataclass
class SoakResult:
    seed: int
    faults: Counter[str]
    acked: int
    tasks: int
    states: Counter[str]
    reruns: int  # tasks that ran more than one attempt
    digest: str
    duration_s: float
    fault_log: str
    # rolls, retention deletes, snapshot downloads, zombie overlaps, load mix, ...
    counts: Counter[str] = field(default_factory=Counter)
    outage_max_s: float = 0.0  # the longest clean outage (a fault of the leader alone)
    outage_bound_s: float = 0.0
    drain_s: float = 0.0
    drain_bound_s: float = 0.0

    def summary(self) -> str:
        return (
            f"chaos soak seed {self.seed}: {sum(self.faults.values())} faults "
            f"{dict(sorted(self.faults.items()))}; {self.acked} acknowledged tasks, "
            f"{self.tasks} on the leader, final states {dict(sorted(self.states.items()))}, "
            f"{self.reruns} re-run with a higher attempt; {dict(sorted(self.counts.items()))}; "
            f"longest outage {self.outage_max_s:.2f} s (bound {self.outage_bound_s:.1f} s); "
            f"drain {self.drain_s:.1f} s (bound {self.drain_bound_s:.0f} s); "
            f"digest {self.digest[:16]}; {self.duration_s:.1f} s"
        )
