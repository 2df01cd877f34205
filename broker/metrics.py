"""Prometheus metrics of one broker: every metric definition lives here.

Each broker owns a :class:`BrokerMetrics` with its own ``CollectorRegistry`` (never the
process-wide default: tests run several brokers in one process), served at ``/metrics``.

Where things are counted, and why:

- Task counters (submitted, assigned, finished, failed, cancelled, failed attempts) are
  counted **at the acting leader only**, in its write path right after ``apply`` of a
  durable entry (:meth:`BrokerMetrics.observe_applied`, called by ``Node``): each
  acknowledged write is counted once, by the process that made it. Counting on every
  broker would make followers count the same history again (summing brokers would
  multiply it) and would count a restart's log replay as new work. ``apply`` stays pure:
  the observer only reads the entry, apply's result and the tasks that became final.
  After a fail-over the new leader's counters start at 0, which Prometheus' ``rate()``
  and ``increase()`` handle as a counter reset; sum them over brokers for cluster totals.
- Queue lengths, tasks by state and connected workers are read from the state machine
  at scrape time (:class:`_StateCollector`): nothing is stored twice.
- Log append latency and group-commit batch sizes are observed by the leader's write
  path in ``Node``; follower lag by a follower while it tails the leader's ledger;
  leadership terms by the cluster broker; snapshot durations and sizes where the
  snapshot is written (``Node.take_snapshot``), on every broker.

The hot path costs a dictionary lookup and a counter increment per task and one
histogram observation per appended entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from broker import entries as e
from broker.state import (
    QUEUED_STATES,
    ApplyResult,
    Rejected,
    ReplayedResults,
    TaskRef,
    TaskState,
    WorkerState,
)

if TYPE_CHECKING:
    from broker.state import StateMachine

#: The exposition format ``/metrics`` serves (Prometheus text format 0.0.4).
CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"

# Appends are fsync'd (file ledgers) or acknowledged by Pulsar: ~100 us to seconds.
_LATENCY_BUCKETS_S: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
_BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SNAPSHOT_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_Inc = Callable[[float], None]


class _TaskCounter:
    """A counter by (tenant, task type) whose label children are cached: ``labels()``
    validates and locks on every call, a dictionary lookup does not."""

    __slots__ = ("_children", "_counter")

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._children: dict[tuple[str, str], _Inc] = {}

    def inc(self, tenant: str, task_type: str) -> None:
        key = (tenant, task_type)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._counter.labels(tenant, task_type).inc
        child(1)


class BrokerMetrics:
    """The metrics of one broker process (see the module docstring for who counts what)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        by_task = ["tenant", "type"]
        self.submitted = _TaskCounter(
            Counter(
                "steward_tasks_submitted",
                "Tasks accepted by submissions (counted by the leader that logged them)",
                by_task,
                registry=registry,
            )
        )
        self.rejected = Counter(
            "steward_task_submissions_rejected",
            "Tasks of submissions refused by the state machine, by error code",
            ["tenant", "code"],
            registry=registry,
        )
        self.assigned = _TaskCounter(
            Counter(
                "steward_tasks_assigned",
                "Task attempts assigned to workers",
                by_task,
                registry=registry,
            )
        )
        self.finished = _TaskCounter(
            Counter(
                "steward_tasks_finished",
                "Tasks that finished successfully",
                by_task,
                registry=registry,
            )
        )
        self.failed = _TaskCounter(
            Counter(
                "steward_tasks_failed",
                "Tasks that ended in error for good (attempts used up, deadline, lost worker)",
                by_task,
                registry=registry,
            )
        )
        self.cancelled = _TaskCounter(
            Counter(
                "steward_tasks_cancelled",
                "Tasks that ended cancelled",
                by_task,
                registry=registry,
            )
        )
        self.attempt_failures = _TaskCounter(
            Counter(
                "steward_task_attempt_failures",
                "Failed attempts reported by workers (retried or final)",
                by_task,
                registry=registry,
            )
        )
        self.append_latency = Histogram(
            "steward_log_append_latency_seconds",
            "From handing an entry to the ledger until it is durable (group commit)",
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.group_commit = Histogram(
            "steward_log_group_commit_entries",
            "Entries made durable together by one group commit",
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.follower_lag_seconds = Gauge(
            "steward_follower_lag_seconds",
            "Follower only: from the leader stamping the entry last applied here until this"
            " broker applied it (0 on a leader)",
            registry=registry,
        )
        self.follower_lag_entries = Gauge(
            "steward_follower_lag_entries",
            "Follower only: entries read from the leader's ledger but not applied yet"
            " (waiting for the leader's confirmation)",
            registry=registry,
        )
        self.leader_changes = Counter(
            "steward_leader_changes",
            "Leadership terms this broker saw begin (a new leader, or the same one again)",
            registry=registry,
        )
        self.leaderships = Counter(
            "steward_leaderships_acquired",
            "Times this broker took over as the acting leader",
            registry=registry,
        )
        self.snapshot_duration = Histogram(
            "steward_snapshot_duration_seconds",
            "Time to encode, compress and durably write a snapshot",
            buckets=_SNAPSHOT_BUCKETS_S,
            registry=registry,
        )
        self.snapshot_size = Gauge(
            "steward_snapshot_size_bytes",
            "Size of the last snapshot this broker wrote (the file, compressed)",
            registry=registry,
        )
        self.snapshot_body = Gauge(
            "steward_snapshot_body_bytes",
            "Size of the last snapshot's encoded state before compression",
            registry=registry,
        )
        self._state: Callable[[], StateMachine] | None = None
        self._role: Callable[[], str] = lambda: "idle"
        self._position: Callable[[], tuple[int, int]] = lambda: (-1, -1)

    def bind(
        self,
        state: Callable[[], StateMachine],
        role: Callable[[], str],
        position: Callable[[], tuple[int, int]],
    ) -> None:
        """Read queue lengths, role and log position from these at scrape time."""
        if self._state is None:
            self.registry.register(_StateCollector(self))
        self._state, self._role, self._position = state, role, position

    def render(self) -> bytes:
        """The exposition text of every metric of this broker."""
        return generate_latest(self.registry)

    # --- leader write path -----------------------------------------------------------

    def observe_applied(
        self, entry: e.Entry, result: ApplyResult, final: list[int], state: StateMachine
    ) -> None:
        """Count what a durable entry did; called by the leader right after apply."""
        kind = type(entry)
        tasks = state.tasks
        if kind is e.SubmitTasks:
            assert isinstance(entry, e.SubmitTasks)
            if isinstance(result, ReplayedResults):
                pass  # an idempotent retry: nothing was created this time
            elif isinstance(result, list):
                for spec, outcome in zip(entry.tasks, result, strict=False):
                    if isinstance(outcome, TaskRef):
                        self.submitted.inc(spec.tenant, spec.type)
                    else:
                        self.rejected.labels(spec.tenant, outcome.code.value).inc()
            elif isinstance(result, Rejected):
                for spec in entry.tasks:
                    self.rejected.labels(spec.tenant, result.code.value).inc()
        elif kind is e.AssignTasks:
            assert isinstance(entry, e.AssignTasks) and isinstance(result, list)
            for assignment, outcome in zip(entry.assignments, result, strict=False):
                task = tasks.get(assignment.task_id)
                if isinstance(outcome, TaskRef) and task is not None:
                    self.assigned.inc(task.tenant, task.type)
        elif kind is e.FinishTasks:
            assert isinstance(entry, e.FinishTasks) and isinstance(result, list)
            for report, outcome in zip(entry.outcomes, result, strict=False):
                task = tasks.get(report.task_id)
                if not report.ok and isinstance(outcome, TaskRef) and task is not None:
                    self.attempt_failures.inc(task.tenant, task.type)
        for task_id in final:
            task = tasks.get(task_id)
            if task is None:
                continue
            if task.state == TaskState.FINISHED:
                self.finished.inc(task.tenant, task.type)
            elif task.state == TaskState.ERROR:
                self.failed.inc(task.tenant, task.type)
            elif task.state == TaskState.CANCELLED:
                self.cancelled.inc(task.tenant, task.type)

    def observe_batch(self, entries: int) -> None:
        self.group_commit.observe(entries)


class _StateCollector(Collector):
    """Gauges computed from the live state at scrape time (runs on the event loop, in
    the /metrics request, so the state does not change under it)."""

    def __init__(self, metrics: BrokerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        metrics = self._metrics
        state_of = metrics._state
        if state_of is None:
            return
        state = state_of()
        queue = GaugeMetricFamily(
            "steward_queue_length",
            "Tasks of a tenant waiting to run (pending, delayed, waiting)",
            labels=["tenant"],
        )
        by_state = GaugeMetricFamily(
            "steward_tasks", "Tasks in the state by tenant and state", labels=["tenant", "state"]
        )
        for tenant, counts in sorted(state.tenant_counts.items()):
            queue.add_metric([tenant], sum(counts.get(s, 0) for s in QUEUED_STATES))
            for name, count in counts.items():
                by_state.add_metric([tenant, name], count)
        yield queue
        yield by_state
        workers = GaugeMetricFamily("steward_workers_connected", "Workers connected")
        workers.add_metric(
            [], sum(1 for w in state.workers.values() if w.state == WorkerState.CONNECTED)
        )
        yield workers
        yield from _role_and_position(metrics._role(), metrics._position(), state)


def _role_and_position(
    role: str, position: tuple[int, int], state: StateMachine
) -> Iterator[Metric]:
    roles = GaugeMetricFamily(
        "steward_broker_role", "1 for this broker's current role", labels=["role"]
    )
    roles.add_metric([role], 1)
    yield roles
    ledger = GaugeMetricFamily("steward_log_position_ledger", "Ledger of the last applied entry")
    ledger.add_metric([], position[0])
    yield ledger
    entry = GaugeMetricFamily(
        "steward_log_position_entry", "Entry id (in its ledger) of the last applied entry"
    )
    entry.add_metric([], position[1])
    yield entry
    applied = GaugeMetricFamily(
        "steward_entries_applied", "Entries applied to this broker's state since its history began"
    )
    applied.add_metric([], state.entries_applied)
    yield applied
