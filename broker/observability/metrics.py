"""Prometheus metrics of one broker: every metric definition lives here.

Each broker owns a :class:`BrokerMetrics` with its own ``CollectorRegistry`` (never the
process-wide default: tests run several brokers in one process), served at ``/metrics``.

Where things are counted, and why:

- Task counters (submitted, assigned, finished, failed, cancelled, failed attempts) are
  counted **at the acting leader only**, in its write path right after ``apply`` of a
  durable entry (:meth:`BrokerMetrics.observe_applied`, a leader listener of the node
  registered by ``observe_node`` in broker/observability/node_observer.py): each
  acknowledged write is counted once, by the process that made it. Counting on every
  broker would make followers count the same history again (summing brokers would
  multiply it) and would count a restart's log replay as new work. ``apply`` stays pure:
  the observer only reads the entry, apply's result and the tasks that became final.
  After a fail-over the new leader's counters start at 0, which Prometheus' ``rate()``
  and ``increase()`` handle as a counter reset; sum them over brokers for cluster totals.
- Queue lengths, tasks by state and connected workers are read from the state machine
  at scrape time (:class:`_Collector`): nothing is stored twice.
- Log append latency and group-commit batch sizes are observed by the leader's write
  path (replication reports to its ``ReplicationMetrics`` Protocol, which this class
  satisfies); follower lag by a follower while it tails the leader's ledger;
  leadership terms by the cluster broker; snapshot durations and sizes where the
  snapshot is written (the node's snapshots), on every broker.

Conventions (``promtool check metrics`` checks them in
tests/integration/test_newcomer_openapi.py): counters end in ``_total``, no ``_created``
series, the standard ``process_*`` and ``python_*`` collectors, ``steward_build_info``, and
every label takes a bounded set of values: a task type no worker declared and no built-in
task has is counted as ``other`` (callers choose types freely), an unmatched path as route
``other``.

The hot path costs a dict update per counted task and a bisect and two additions per
appended entry: those series are plain Python (:class:`_TaskCounter`,
:class:`_FastHistogram`) turned into metric families at scrape time, because
prometheus-client's own ``labels().inc()`` and ``observe()`` lock on every call.
"""

from __future__ import annotations

import bisect
import math
import platform
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from broker.core import (
    QUEUED_STATES,
    Applied,
    Rejected,
    TaskRef,
    TaskState,
    TreeState,
    WorkerState,
)
from broker.core import entries as e
from broker.replication.node import VERSION

if TYPE_CHECKING:
    from broker.core import StateMachine

#: The exposition format ``/metrics`` serves (Prometheus text format 0.0.4).
CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"

# A counter's ``_created`` series doubles every counter's series for a timestamp nobody
# graphs; prometheus-client has only this process-wide switch (the broker process is ours).
disable_created_metrics()  # type: ignore[no-untyped-call]

#: The task types built into every worker (clients/worker/task_api.py's BUILTIN_TASKS; a
#: unit test keeps the two equal): always their own ``type`` label value.
BUILTIN_TASK_TYPES: Final = frozenset({"noop", "sleep", "fail", "spark.sql"})
#: The ``type`` label of a task whose type is neither built in nor declared by a worker.
OTHER: Final = "other"
# Types declared by workers get their own label up to this many; the rest are "other".
_MAX_TYPE_LABELS: Final = 200
# HTTP request latency: a submission takes ~1 ms; long polls and event streams up to minutes.
_HTTP_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                          5.0, 10.0, 30.0, 60.0)  # fmt: skip

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
_BATCH_BUCKETS: Final = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)
# A tree's completion latency: from its root's submission until its last ack; trees run
# from milliseconds (a noop fan-out) to hours (their timeout is at most a day).
_TREE_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
                          900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)  # fmt: skip
# The reason the state machine gives a tree run that timed out (broker/core/state.py).
_TREE_TIMED_OUT: Final = "tree timed out"
_SNAPSHOT_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _TaskCounter:
    """A counter by (tenant, task type) kept as a plain dict and exposed at scrape time:
    prometheus-client's ``labels().inc()`` takes locks and validates labels on every
    call (about 3 us), a dict update costs a tenth of that on the hot path."""

    __slots__ = ("counts", "help", "name")

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self.counts: dict[tuple[str, str], int] = {}

    def inc(self, tenant: str, task_type: str) -> None:
        key = (tenant, task_type)
        self.counts[key] = self.counts.get(key, 0) + 1

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.help, labels=["tenant", "type"])
        for labels, count in sorted(self.counts.items()):
            family.add_metric(list(labels), count)
        return family


class _TenantCounter:
    """A counter by tenant kept as a plain dict (like _TaskCounter), exposed at scrape time."""

    __slots__ = ("counts", "help", "name")

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self.counts: dict[str, int] = {}

    def inc(self, tenant: str) -> None:
        self.counts[tenant] = self.counts.get(tenant, 0) + 1

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.help, labels=["tenant"])
        for tenant, count in sorted(self.counts.items()):
            family.add_metric([tenant], count)
        return family


class _FastHistogram:
    """A histogram observed on the hot path (every appended entry): one bisect and two
    additions, folded into Prometheus' cumulative buckets at scrape time."""

    __slots__ = ("bounds", "counts", "help", "name", "total")

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.help = help_text
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        # bisect_left: the first bound >= amount, i.e. Prometheus' "le" bucket.
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.total += amount

    def family(self) -> Metric:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        family = HistogramMetricFamily(self.name, self.help)
        family.add_metric([], buckets, self.total)
        return family


class _TypeLabels:
    """The ``type`` label of a task type: bounded, so a caller cannot add series at will."""

    __slots__ = ("known",)

    def __init__(self) -> None:
        self.known: set[str] = set(BUILTIN_TASK_TYPES)

    def label(self, task_type: str, state: StateMachine) -> str:
        if task_type in self.known:
            return task_type
        # Declared by a registered worker (operators run those): a type of its own. Only
        # unknown types pay this scan, over the few workers.
        if len(self.known) < _MAX_TYPE_LABELS and any(
            task_type in worker.task_types for worker in state.workers.values()
        ):
            self.known.add(task_type)
            return task_type
        return OTHER


class _HttpRequests:
    """HTTP requests by method, route template and status, with their latency: a dict
    update and a bisect per request, turned into a counter and a histogram at scrape time."""

    __slots__ = ("series",)

    def __init__(self) -> None:
        # (method, route, status) -> [bucket counts..., above every bound, total seconds]
        self.series: dict[tuple[str, str, int], list[float]] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        counts = self.series.get(key)
        if counts is None:
            counts = self.series[key] = [0.0] * (len(_HTTP_BUCKETS_S) + 2)
        counts[bisect.bisect_left(_HTTP_BUCKETS_S, seconds)] += 1
        counts[-1] += seconds

    def families(self) -> Iterator[Metric]:
        labels = ["method", "route", "status"]
        requests = CounterMetricFamily(
            "steward_http_requests", "HTTP requests answered, by route template and status",
            labels=labels,
        )  # fmt: skip
        latency = HistogramMetricFamily(
            "steward_http_request_duration_seconds",
            "From a request's dispatch until its answer was sent (a long poll's or event"
            " stream's whole wait included)",
            labels=labels,
        )
        for key, counts in sorted(self.series.items()):
            cumulative = 0.0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*_HTTP_BUCKETS_S, math.inf), counts, strict=False):
                cumulative += count
                buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
            method, route, status = key
            values = [method, route, str(status)]
            requests.add_metric(values, cumulative)
            latency.add_metric(values, buckets, counts[-1])
        yield requests
        yield latency


class BrokerMetrics:
    """The metrics of one broker process (see the module docstring for who counts what)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        # The standard collectors every Prometheus client exposes (process_*, python_*).
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.types = _TypeLabels()
        self.http = _HttpRequests()
        self.submitted = _TaskCounter(
            "steward_tasks_submitted",
            "Tasks accepted by submissions (counted by the leader that logged them)",
        )
        self.rejected = Counter(
            "steward_task_submissions_rejected",
            "Tasks of submissions refused by the state machine, by error code",
            ["tenant", "code"],
            registry=registry,
        )
        self.assigned = _TaskCounter(
            "steward_tasks_assigned",
            "Task attempts assigned to workers",
        )
        self.finished = _TaskCounter(
            "steward_tasks_finished",
            "Tasks that finished successfully",
        )
        self.failed = _TaskCounter(
            "steward_tasks_failed",
            "Tasks that ended in error for good (attempts used up, deadline, lost worker)",
        )
        self.cancelled = _TaskCounter(
            "steward_tasks_cancelled",
            "Tasks that ended cancelled",
        )
        self.attempt_failures = _TaskCounter(
            "steward_task_attempt_failures",
            "Failed attempts reported by workers (retried or final)",
        )
        self.trees_started = _TenantCounter(
            "steward_trees_started", "Tracked task trees started (roots accepted by submissions)"
        )
        self.trees_completed = _TenantCounter(
            "steward_trees_completed", "Tracked task trees that completed (every task acked)"
        )
        self.trees_failed = _TenantCounter(
            "steward_trees_failed",
            "Tracked task trees that failed for good (a task failed or was cancelled)",
        )
        self.trees_timed_out = _TenantCounter(
            "steward_trees_timed_out", "Tracked task trees that failed for good by timing out"
        )
        self.ticks_fired = _TenantCounter(
            "steward_schedule_ticks_fired",
            "Schedule ticks that created their task (counted by the leader that fired them)",
        )
        self.ticks_missed = _TenantCounter(
            "steward_schedule_ticks_missed",
            "Schedule ticks no leader fired in time that the missed-tick policy dropped",
        )
        self.ticks_refused = _TenantCounter(
            "steward_schedule_ticks_refused",
            "Schedule ticks whose task the state machine refused (the schedule's last_error)",
        )
        self.tree_latency = _FastHistogram(
            "steward_tree_completion_seconds",
            "From a completed tree's root submission until its last ack (replays included)",
            _TREE_BUCKETS_S,
        )
        self.append_latency = _FastHistogram(
            "steward_log_append_latency_seconds",
            "From handing an entry to the ledger until it is durable (group commit)",
            _LATENCY_BUCKETS_S,
        )
        self.group_commit = _FastHistogram(
            "steward_log_group_commit_entries",
            "Entries made durable together by one group commit",
            _BATCH_BUCKETS,
        )
        # Bound by the server to its code store (bind_code_store); 0 without one.
        self.code_store_bytes = Gauge(
            "steward_code_store_bytes",
            "Bytes of the code artifacts in this broker's store",
            registry=registry,
        )
        self.code_store_artifacts = Gauge(
            "steward_code_store_artifacts",
            "Code artifacts in this broker's store",
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
        registry.register(_Collector(self))

    def bind_code_store(self, usage: Callable[[], tuple[int, int]]) -> None:
        """Read the store's (artifact count, bytes) at each scrape (a directory scan)."""
        self.code_store_artifacts.set_function(lambda: usage()[0])
        self.code_store_bytes.set_function(lambda: usage()[1])

    def bind(
        self,
        state: Callable[[], StateMachine],
        role: Callable[[], str],
        position: Callable[[], tuple[int, int]],
    ) -> None:
        """Read queue lengths, role and log position from these at scrape time."""
        self._state, self._role, self._position = state, role, position

    def render(self) -> bytes:
        """The exposition text of every metric of this broker."""
        return generate_latest(self.registry)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered HTTP request (``route``: its template, or ``other``)."""
        self.http.observe(method, route, status, seconds)

    # --- leader write path -----------------------------------------------------------

    def observe_applied(self, entry: e.Entry, applied: Applied, state: StateMachine) -> None:
        """Count what a durable entry did; called by the leader right after apply."""
        result = applied.result
        if isinstance(entry, e.SubmitTasks):
            # type() is: a ReplayedResults (an idempotent retry) created nothing.
            if type(result) is list:
                submitted = self.submitted.counts
                label = self.types.label
                for spec, outcome in zip(entry.tasks, result, strict=False):
                    if type(outcome) is TaskRef:
                        key = (spec.tenant, label(spec.type, state))
                        submitted[key] = submitted.get(key, 0) + 1
                        if spec.track_tree:
                            self.trees_started.inc(spec.tenant)
                    elif isinstance(outcome, Rejected):
                        self.rejected.labels(spec.tenant, outcome.code.value).inc()
            elif isinstance(result, Rejected):
                for spec in entry.tasks:
                    self.rejected.labels(spec.tenant, result.code.value).inc()
        elif isinstance(entry, e.FinishTasks) and isinstance(result, list):
            tasks = state.tasks
            for report, outcome in zip(entry.outcomes, result, strict=False):
                if not report.ok and not report.released and type(outcome) is TaskRef:
                    task = tasks.get(report.task_id)
                    if task is not None:
                        self.attempt_failures.inc(task.tenant, self.types.label(task.type, state))
        elif isinstance(entry, e.FireSchedule):
            self._count_firing(entry, result, state)
        # Assignments are effects: an AssignTasks entry's, or those a submit carried.
        for started in applied.assigned:
            task = state.tasks.get(started.task_id)
            if task is not None:
                self.assigned.inc(task.tenant, self.types.label(task.type, state))
        final = applied.final_ids
        if final:
            self._count_final(final, state)
        if state.trees:  # no tracked tree kept: skip scanning the effects again
            for root in applied.trees_ended:
                self._count_tree_end(root, state)

    def _count_firing(self, entry: e.FireSchedule, result: object, state: StateMachine) -> None:
        schedule = state.schedules.get((entry.tenant, entry.name))
        if schedule is None:
            return
        if isinstance(result, Rejected):
            # Refused before it changed anything (a tick handled already) or the tick's
            # submit was refused: only the latter is stored as the schedule's last_error.
            if schedule.last_error != f"{result.code.value}: {result.message}":
                return
            self.ticks_refused.inc(entry.tenant)
        elif type(result) is TaskRef:
            self.ticks_fired.inc(entry.tenant)
            # The tick's task is a submission too (its finish is counted like any other).
            key = (entry.tenant, self.types.label(schedule.task.type, state))
            self.submitted.counts[key] = self.submitted.counts.get(key, 0) + 1
        if entry.skipped:
            counts = self.ticks_missed.counts
            counts[entry.tenant] = counts.get(entry.tenant, 0) + entry.skipped

    def _count_tree_end(self, root: int, state: StateMachine) -> None:
        tree = state.trees.get(root)
        task = state.tasks.get(root)
        if tree is None or task is None:
            return
        if tree.state == TreeState.COMPLETED:
            self.trees_completed.inc(tree.tenant)
            if tree.ended_ms is not None:
                self.tree_latency.observe(max(0, tree.ended_ms - task.created_ms) / 1000)
        elif tree.reason == _TREE_TIMED_OUT:
            self.trees_timed_out.inc(tree.tenant)
        else:
            self.trees_failed.inc(tree.tenant)

    def _count_final(self, final: list[int], state: StateMachine) -> None:
        tasks = state.tasks
        label = self.types.label
        for task_id in final:
            task = tasks.get(task_id)
            if task is None:
                continue
            if task.state == TaskState.FINISHED:
                self.finished.inc(task.tenant, label(task.type, state))
            elif task.state == TaskState.ERROR:
                self.failed.inc(task.tenant, label(task.type, state))
            elif task.state == TaskState.CANCELLED:
                self.cancelled.inc(task.tenant, label(task.type, state))

    def tree_counters(self) -> tuple[_TenantCounter, ...]:
        return (self.trees_started, self.trees_completed, self.trees_failed, self.trees_timed_out)

    def schedule_counters(self) -> tuple[_TenantCounter, ...]:
        return (self.ticks_fired, self.ticks_missed, self.ticks_refused)

    def task_counters(self) -> tuple[_TaskCounter, ...]:
        return (
            self.submitted,
            self.assigned,
            self.finished,
            self.failed,
            self.cancelled,
            self.attempt_failures,
        )

    def observe_batch(self, entries: int) -> None:
        self.group_commit.observe(entries)


class _Collector(Collector):
    """The hot-path counters and histograms, and gauges computed from the live state, at
    scrape time (on the event loop, in the /metrics request: nothing changes under it)."""

    def __init__(self, metrics: BrokerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        metrics = self._metrics
        for counter in metrics.task_counters():
            yield counter.family()
        for tenant_counter in (*metrics.tree_counters(), *metrics.schedule_counters()):
            yield tenant_counter.family()
        yield metrics.tree_latency.family()
        yield metrics.append_latency.family()
        yield metrics.group_commit.family()
        yield from metrics.http.families()
        build = GaugeMetricFamily(
            "steward_build_info", "Always 1: this broker's version and Python's",
            labels=["version", "python_version"],
        )  # fmt: skip
        build.add_metric([VERSION, platform.python_version()], 1)
        yield build
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
        disconnected = GaugeMetricFamily(
            "steward_workers_disconnected",
            "Workers whose connection closed, not yet back or declared dead",
        )
        disconnected.add_metric(
            [], sum(1 for w in state.workers.values() if w.state == WorkerState.DISCONNECTED)
        )
        yield disconnected
        pending = GaugeMetricFamily(
            "steward_trees_pending", "Tracked task trees pending (waiting for acks)",
            labels=["tenant"],
        )  # fmt: skip
        pending_by_tenant: dict[str, int] = {}
        for tree in state.trees.values():
            if tree.state == TreeState.PENDING:
                pending_by_tenant[tree.tenant] = pending_by_tenant.get(tree.tenant, 0) + 1
        for tenant, count in sorted(pending_by_tenant.items()):
            pending.add_metric([tenant], count)
        yield pending
        schedules = GaugeMetricFamily(
            "steward_schedules", "Periodic-task schedules", labels=["tenant"]
        )
        paused = GaugeMetricFamily(
            "steward_schedules_paused", "Periodic-task schedules paused", labels=["tenant"]
        )
        by_tenant: dict[str, int] = {}
        paused_by_tenant: dict[str, int] = {}
        for (tenant, _), schedule in state.schedules.items():
            by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
            if schedule.paused_ms is not None:
                paused_by_tenant[tenant] = paused_by_tenant.get(tenant, 0) + 1
        for tenant, count in sorted(by_tenant.items()):
            schedules.add_metric([tenant], count)
            paused.add_metric([tenant], paused_by_tenant.get(tenant, 0))
        yield schedules
        yield paused
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
    applied = CounterMetricFamily(
        "steward_entries_applied", "Entries applied to this broker's state since its history began"
    )
    applied.add_metric([], state.entries_applied)
    yield applied
