"""What task code sees: the task context, the built-in task types, result encoding.

Shared by the worker process (types registered in-process, and report building) and the
task processes (``clients/worker/task_processes/child.py``) that run tenant code; see
docs/SECURITY.md for why tenant code never runs in the worker process.

Spark. With the worker's Spark Connect server (``--spark connect``, the default with task
processes; ``clients/worker/spark/connect_server.py``), ``ctx.spark`` is a Spark Connect session
of the attempt's own, made on first use, its operations tagged ``steward-<task_id>-<attempt>``
(``addTag``, per thread), released when the attempt ends. It has no ``sparkContext``: the
classic API (RDDs) is ``ctx.classic_spark``, where the worker allows it.

Classic (``ctx.classic_spark``; ``ctx.spark`` with ``--spark classic`` or thread isolation).
A process has one classic SparkSession, created on first use and kept for the life of the
process. PySpark runs in pinned thread mode (the default since 3.2:
each Python thread has its own JVM thread), so the job group set with
``SparkContext.setJobGroup`` in the task's thread tags exactly that task's jobs.
``ctx.spark`` sets it (``steward-<task_id>-<attempt>``, interrupt on cancel) in every
thread that asks for the session; threads a task starts itself must also go through
``ctx.spark`` (or use ``pyspark.InheritableThread``) to be tagged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Final

from clients.worker.config import cpu_count
from wire.worker_protocol import (
    DEFAULT_MAX_LOST,
    MAX_PROGRESS_CHARS,
    AssignedTask,
    SpawnRequest,
)

logger = logging.getLogger(__name__)
task_logger_parent: Final = logging.getLogger("steward.task")

TaskFn = Callable[[Any, "TaskContext"], Any]

DEFAULT_SQL_MAX_ROWS: Final = 1000
MAX_ERROR_CHARS: Final = 64 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class SpawnedChild:
    """A child this task spawned (``ctx.spawn``'s answer): its id is given when the task's
    finish is logged, so later children of the same task anchor to it by this handle."""

    index: int  # among this attempt's children


class TaskCancelled(Exception):
    """Raised inside a task by :meth:`TaskContext.check_cancelled` once it is cancelled."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# -- the shared SparkSession (the one piece of process-wide state) --

_spark_lock = threading.Lock()
_spark_session: Any = None


def spark_defaults(master: str) -> dict[str, str]:
    defaults = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }
    if master.startswith("local"):
        defaults.update(
            {
                # One machine: the default 200 shuffle partitions are pure overhead.
                "spark.sql.shuffle.partitions": str(max(2, cpu_count())),
                "spark.default.parallelism": str(max(2, cpu_count())),
                # Listen on loopback only (the driver's RPC and block manager ports).
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
            }
        )
    return defaults


def shared_spark(master: str = "local[*]", conf: Mapping[str, str] | None = None) -> Any:
    """The process's SparkSession: created on the first call, the same object afterwards.

    ``master`` and ``conf`` only matter for the first call (one JVM per process).
    """
    global _spark_session
    with _spark_lock:
        session = _spark_session
        if session is not None and session.sparkContext._jsc is not None:
            return session
        if session is not None:
            logger.warning("the shared SparkSession was stopped; creating a new one")
        from pyspark.sql import SparkSession

        if master.startswith("local"):
            # Spark's own address lookup (before the conf applies) otherwise picks the
            # host's external interface; everything here stays on loopback.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder: Any = SparkSession.builder.master(master).appName("steward-worker")
        for key, value in {**spark_defaults(master), **(conf or {})}.items():
            builder = builder.config(key, value)
        started = time.monotonic()
        _spark_session = builder.getOrCreate()
        logger.info(
            "SparkSession started (master %s) in %.1f s", master, time.monotonic() - started
        )
        return _spark_session


def _cancel_job_group(session: Any, group: str, reason: str) -> None:
    # Not cancelJobGroupAndFutureJobs: it remembers the group for good, so a later task
    # with the same id and attempt (a broker whose data was reset) would be killed at
    # once; and it does not cover every late job anyway (see the module docstring).
    sc = session.sparkContext
    try:
        sc._jsc.sc().cancelJobGroup(group, reason)  # the reason shows in the job's error
    except Exception:  # a Spark without the (group, reason) overload
        logger.debug("falling back to SparkContext.cancelJobGroup", exc_info=True)
        sc.cancelJobGroup(group)


# -- the task context --


class _TaskLogFilter(logging.Filter):
    def __init__(self, task_id: int, attempt: int, tenant: str) -> None:
        super().__init__()
        self.task_id = task_id
        self.attempt = attempt
        self.tenant = tenant

    def filter(self, record: logging.LogRecord) -> bool:
        record.task_id = self.task_id
        record.attempt = self.attempt
        record.tenant = self.tenant
        return True


def make_task_logger(task_id: int, attempt: int, tenant: str) -> logging.Logger:
    """A logger under ``steward.task`` whose records carry task_id, attempt and tenant.

    Built directly rather than with logging.getLogger, which would keep one logger per
    task in the logging manager forever.
    """
    task_logger = logging.Logger(f"steward.task.{task_id}")
    task_logger.parent = task_logger_parent
    task_logger.addFilter(_TaskLogFilter(task_id, attempt, tenant))
    return task_logger


class TaskContext:
    """What a task function gets besides its params."""

    def __init__(
        self,
        task: AssignedTask,
        *,
        params: Any = None,
        spark_factory: Callable[[], Any] | None = None,
        max_result_bytes: int = 1024 * 1024,
        connect_factory: Callable[[], Any] | None = None,
        spark_unavailable: str | None = None,
        classic_unavailable: str | None = None,
    ) -> None:
        self.task_id = task.task_id
        self.attempt = task.attempt
        self.tenant = task.tenant
        self.type = task.type
        self.code = task.code
        self.deadline_ms = task.deadline_ms
        self.resources = dict(task.resources)
        self.params = params
        self.max_result_bytes = max_result_bytes
        self.cancelled = threading.Event()
        self.cancel_reason: str | None = None
        self._spark_factory = spark_factory or shared_spark
        # Spark Connect: a factory of this attempt's session (None: classic or no Spark).
        self._connect_factory = connect_factory
        self._spark_unavailable = spark_unavailable  # why ctx.spark is refused, if it is
        self._classic_unavailable = classic_unavailable  # ... and ctx.classic_spark
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()  # held while the session is made
        self._group_threads: set[int] = set()
        self._session: Any = None
        self._connect_session: Any = None
        self._connect_threads: set[int] = set()
        self._spawns: list[SpawnRequest] = []
        self._spawn_bytes = 0
        # The latest ctx.progress: (reports so far, fraction, message); where it goes from
        # a task process (its host's sender; None: the worker reads it here).
        self._progress: tuple[int, float, str] | None = None
        self._progress_sink: Callable[[float, str], None] | None = None

    @functools.cached_property
    def logger(self) -> logging.Logger:
        # Made on first use: most tasks never log, and a Logger costs more than a no-op task.
        return make_task_logger(self.task_id, self.attempt, self.tenant)

    #: Children one task may spawn (the broker's default limit).
    MAX_SPAWNS: ClassVar[int] = 10_000
    #: Largest params of one child (the broker's default limit).
    MAX_SPAWN_PARAMS_BYTES: ClassVar[int] = 64 * 1024

    def spawn(
        self,
        type: str,
        params: Any = None,
        *,
        anchors: Sequence[int | SpawnedChild] | None = None,
        tracked: bool = True,
        tenant: str | None = None,
        slot: str | None = None,
        max_attempts: int = 1,
        deadline_ms: int | None = None,
        start_after_ms: int | None = None,
        resources: Mapping[str, float] | None = None,
        code: str | None = None,
        max_lost: int = DEFAULT_MAX_LOST,
    ) -> SpawnedChild:
        """Create a child task when this task finishes successfully.

        The children travel with the task's finish report and are created by the same
        log entry that records the finish: a task that fails, crashes or is cancelled
        spawns nothing. ``anchors``: None anchors the child to this task; otherwise task
        ids of this task's tree (``ctx.task_id`` for this one; several make a DAG) or
        children spawned before by this task (what ``spawn`` returns). A child anchored to
        other tasks than this one is a join: it waits until all of them finished, and the
        tree completes only when every path is acked (Storm's multi-anchoring).
        ``tracked=False`` spawns outside the tree (Storm's unanchored emit). Children of
        an untracked task are never tracked. ``tenant`` and ``code`` default to this
        task's. ``max_lost``: attempts the child may lose with its worker before it fails
        (not counted against ``max_attempts``; docs/TASKS.md). The broker validates the rest;
        an invalid child fails this task.
        """
        if not tracked and anchors:
            raise ValueError("an untracked child takes no anchors")
        if tracked and anchors is not None and not anchors:
            raise ValueError("anchors=[] would leave the child untracked: say tracked=False")
        try:
            encoded = encode_result(params, self.MAX_SPAWN_PARAMS_BYTES)
        except ValueError as exc:
            raise ValueError(f"spawn {type!r}: params: {exc}") from None
        anchor_self = tracked and (anchors is None or self.task_id in anchors)
        siblings = tuple(
            dict.fromkeys(a.index for a in anchors or () if isinstance(a, SpawnedChild))
        )
        others = tuple(
            dict.fromkeys(
                int(a)
                for a in anchors or ()
                if not isinstance(a, SpawnedChild) and a != self.task_id
            )
        )
        request = SpawnRequest(
            type=type,
            params=encoded,
            tenant=tenant,
            tracked=tracked,
            anchor_self=anchor_self,
            anchors=others if tracked else (),
            slot=slot,
            max_attempts=max_attempts,
            deadline_ms=deadline_ms,
            start_after_ms=start_after_ms,
            resources=dict(resources or {}),
            code=code,
            anchor_spawns=siblings if tracked else (),
            max_lost=max_lost,
        )
        with self._lock:
            if any(i >= len(self._spawns) for i in siblings):
                raise ValueError("anchors name a child this task did not spawn")
            if len(self._spawns) >= self.MAX_SPAWNS:
                raise ValueError(f"a task may spawn at most {self.MAX_SPAWNS} children")
            if self._spawn_bytes + len(encoded) > self.max_result_bytes:
                raise ValueError(
                    f"the children's params exceed max_result_bytes ({self.max_result_bytes})"
                )
            self._spawns.append(request)
            self._spawn_bytes += len(encoded)
            return SpawnedChild(len(self._spawns) - 1)

    def progress(self, fraction: float, message: str = "") -> None:
        """Report how far this attempt got: ``fraction`` from 0 to 1 and a short message
        (cut at 200 characters). Shown by ``GET /api/v1/tasks/{id}``, ``steward task`` and
        the dashboard within about a second. Cheap to call often: only the latest report
        leaves the worker, at most once a second; it is not durable (the leader keeps it
        in memory: docs/DESIGN.md §6, "Task progress")."""
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not math.isfinite(fraction)
            or not 0 <= fraction <= 1
        ):
            raise ValueError(f"progress fraction must be a number from 0 to 1, not {fraction!r}")
        if not isinstance(message, str):
            raise TypeError(f"progress message must be a str, not {type(message).__name__}")
        self._record_progress(float(fraction), message[:MAX_PROGRESS_CHARS])
        sink = self._progress_sink
        if sink is not None:
            sink(float(fraction), message[:MAX_PROGRESS_CHARS])

    def _record_progress(self, fraction: float, message: str) -> None:
        with self._lock:
            count = self._progress[0] + 1 if self._progress is not None else 1
            self._progress = (count, fraction, message)

    def latest_progress(self) -> tuple[int, float, str] | None:
        """(reports so far, fraction, message) of the latest report, or None."""
        with self._lock:
            return self._progress

    @property
    def spawned(self) -> tuple[SpawnRequest, ...]:
        """The children requested so far (sent with a successful finish)."""
        with self._lock:
            return tuple(self._spawns)

    @property
    def job_group(self) -> str:
        return f"steward-{self.task_id}-{self.attempt}"

    @property
    def uses_spark(self) -> bool:
        with self._lock:
            return bool(self._group_threads) or self._connect_session is not None

    @property
    def spark(self) -> Any:
        """This attempt's Spark Connect session, or (classic) the process's SparkSession.

        Either way this task's operations started from this thread carry its tag / job group.
        """
        self.check_cancelled()
        if self._connect_factory is not None:
            return self._connect_spark()
        if self._spark_unavailable is not None:
            raise RuntimeError(self._spark_unavailable)
        return self._classic_spark()

    @property
    def classic_spark(self) -> Any:
        """The process's classic SparkSession (RDDs, ``sparkContext``), where the worker allows
        it: it starts a JVM in this process on first use (seconds)."""
        self.check_cancelled()
        if self._classic_unavailable is not None:
            raise RuntimeError(self._classic_unavailable)
        return self._classic_spark()

    def _connect_spark(self) -> Any:
        assert self._connect_factory is not None
        with self._connect_lock:
            session = self._connect_session
            if session is None:
                session = self._connect_factory()
                with self._lock:
                    self._connect_session = session
        thread_id = threading.get_ident()
        with self._lock:
            first_in_thread = thread_id not in self._connect_threads
            self._connect_threads.add(thread_id)
        if first_in_thread:  # tags are per thread in a Connect session
            session.addTag(self.job_group)
        # A cancel that came while the session was made did not interrupt it.
        self.check_cancelled()
        return session

    def _classic_spark(self) -> Any:
        session = self._spark_factory()
        thread_id = threading.get_ident()
        with self._lock:
            first_in_thread = thread_id not in self._group_threads
            self._group_threads.add(thread_id)
            self._session = session
        if first_in_thread:
            session.sparkContext.setJobGroup(
                self.job_group,
                f"steward task {self.task_id} attempt {self.attempt} ({self.type}, {self.tenant})",
                interruptOnCancel=True,
            )
        # A cancel that raced with setJobGroup above may have missed this group.
        self.check_cancelled()
        return session

    def check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise TaskCancelled(self.cancel_reason or "cancelled")

    def _cancel(self, reason: str) -> None:
        with self._lock:
            if self.cancel_reason is None:
                self.cancel_reason = reason
        self.cancelled.set()

    def _cancel_spark(self) -> None:
        with self._lock:
            session = self._session if self._group_threads else None
            connect = self._connect_session
        if connect is not None:  # the session is this attempt's alone: all of it
            connect.interruptAll()
        if session is not None:
            _cancel_job_group(session, self.job_group, self.cancel_reason or "cancelled")

    def _release_spark(self) -> None:
        """Release the attempt's Spark Connect session (the server ends what it still runs)."""
        with self._connect_lock, self._lock:
            session, self._connect_session = self._connect_session, None
        if session is not None:
            try:
                session.stop()
            except Exception:
                logger.warning(
                    "could not release Spark session of %s", self.job_group, exc_info=True
                )

    def _leave_job_group(self) -> None:
        """Clear the job group in the calling thread (a pool thread runs other tasks next)."""
        thread_id = threading.get_ident()
        with self._lock:
            session = self._session if thread_id in self._group_threads else None
        if session is not None:
            try:
                session.sparkContext._jsc.clearJobGroup()
            except Exception:
                logger.warning("could not clear Spark job group %s", self.job_group, exc_info=True)


# -- built-in task types --


def _params_dict(params: Any, type_name: str) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ValueError(f"{type_name} params must be a JSON object, got {type(params).__name__}")
    return params


def task_noop(params: Any, ctx: TaskContext) -> None:
    return None


def task_sleep(params: Any, ctx: TaskContext) -> dict[str, float]:
    seconds = _params_dict(params, "sleep").get("seconds", 0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ValueError(f"sleep needs params {{'seconds': number >= 0}}, got {seconds!r}")
    start = time.monotonic()
    # A sleep of a second or more reports its progress once a second (a demo of ctx.progress
    # in the dashboard); a shorter one waits once, as it always did.
    while (left := seconds - (time.monotonic() - start)) > 0:
        if ctx.cancelled.wait(min(left, 1.0) if seconds >= 1 else left):
            ctx.check_cancelled()
        if seconds >= 1:
            slept = min(float(seconds), time.monotonic() - start)
            ctx.progress(slept / seconds, f"slept {slept:.0f} of {seconds:g} s")
    return {"slept": seconds}


def task_fail(params: Any, ctx: TaskContext) -> None:
    message = _params_dict(params, "fail").get("message")
    raise RuntimeError(str(message) if message is not None else "task failed (fail task)")


def task_spark_sql(params: Any, ctx: TaskContext) -> list[Any]:
    """Run one SQL query; the rows as JSON objects (nulls kept), all or an error."""
    p = _params_dict(params, "spark.sql")
    query = p.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ValueError("spark.sql needs params {'query': str, 'max_rows'?: int}")
    max_rows = p.get("max_rows", DEFAULT_SQL_MAX_ROWS)
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"spark.sql max_rows must be an integer >= 0, got {max_rows!r}")
    from pyspark.sql import functions as sf

    df = ctx.spark.sql(query)
    as_json = df.select(sf.to_json(sf.struct("*"), {"ignoreNullFields": "false"}).alias("j"))
    # One row past the cap tells "exactly max_rows" from "more" without collecting all.
    lines: list[str] = [row[0] for row in as_json.limit(max_rows + 1).collect()]
    if len(lines) > max_rows:
        raise ValueError(
            f"spark.sql: the query returned more than max_rows={max_rows} rows;"
            " add a LIMIT or raise max_rows"
        )
    size = 2 + sum(len(line.encode()) + 1 for line in lines)
    if size > ctx.max_result_bytes:
        raise ValueError(
            f"spark.sql: the {len(lines)} rows take about {size} bytes as JSON, over the"
            f" max_result_bytes limit of {ctx.max_result_bytes}; select fewer rows or columns"
        )
    return [json.loads(line) for line in lines]


BUILTIN_TASKS: Final[Mapping[str, TaskFn]] = {
    "noop": task_noop,
    "sleep": task_sleep,
    "fail": task_fail,
    "spark.sql": task_spark_sql,
}


def encode_result(value: Any, max_result_bytes: int) -> bytes:
    """JSON text of a task's return value; ValueError when not JSON or too large."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"the task's result is not JSON-serializable: {exc}") from None
    data = text.encode()
    if len(data) > max_result_bytes:
        raise ValueError(
            f"the task's result is {len(data)} bytes of JSON, over the max_result_bytes"
            f" limit of {max_result_bytes}"
        )
    return data


def call_task(
    ctx: TaskContext, raw_params: bytes, resolve: Callable[[], TaskFn], max_result_bytes: int
) -> bytes:
    """Decode the params, resolve and call the task function, encode its result.

    The one sequence both places that run task code use (a worker thread, a task
    process); every exception propagates to the caller, which reports it.
    """
    ctx.check_cancelled()
    try:
        ctx.params = json.loads(raw_params) if raw_params else None
    except ValueError as exc:
        raise ValueError(f"the task's params are not valid JSON: {exc}") from None
    fn = resolve()
    ctx.check_cancelled()
    value = fn(ctx.params, ctx)
    ctx.check_cancelled()
    return encode_result(value, max_result_bytes)


def error_text(exc: BaseException, max_chars: int = MAX_ERROR_CHARS) -> str:
    """The message first (what a user reads), then the formatted traceback, capped.

    The first line is ``Type: message``, what ``steward submit --wait`` and the dashboard
    show: a message that starts with blank lines (Spark's exceptions, whose text begins
    with a newline: ``\n[PARSE_SYNTAX_ERROR] Syntax error ...``) starts at its first line
    with words, the rest follows on the next lines."""
    lines = str(exc).splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    message = "\n".join(lines).rstrip()
    text = f"{type(exc).__name__}: {message}\n\n{''.join(traceback.format_exception(exc))}"
    if len(text) > max_chars:
        # Keep the head (the message) and the tail (where it was raised).
        half = max_chars // 2
        text = f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"
    return text
