"""The task runtime: runs assigned tasks and turns their outcomes into reports.

A task type names a callable ``fn(params, ctx)``: one of the built-ins (``noop``,
``sleep``, ``fail``, ``spark.sql``), one registered with :meth:`TaskRuntime.register`, or
``module:function`` from the task's code artifact. ``params`` is the decoded JSON;
``ctx`` is a :class:`TaskContext` (``clients/worker/task_api.py``). The return value
becomes the task's JSON result.

Where tasks run. With ``task_isolation="process"`` (the default) the built-in types and
every code artifact, i.e. everything a tenant supplies, run in task processes
(``clients/worker/task_processes/pool.py``): one tenant per process, under a uid that is not the
worker's, and a cancel ends the process. Types registered with :meth:`TaskRuntime.register`
are the embedding program's own code and run in the worker process, on a thread, as does
everything with ``task_isolation="thread"`` (trusted single-tenant setups and tests).

Slots. A task on a thread holds one thread of a ``ThreadPoolExecutor`` sized to the sum
of the worker's task-type capacities. A task for a task process holds no thread: when a
warm process of its tenant is idle and its code is already copied, :meth:`TaskRuntime.start`
sends it there directly; otherwise a pool thread downloads the code or starts a process
first. The pool's one dispatcher thread reads every process's pipes and reports outcomes.

Cancelling (a broker Cancel, a dropped task, the deadline) sets ``ctx.cancelled``. In a
task process it also sends SIGTERM (which raises :class:`TaskCancelled` in the task) and,
if the task has not ended ``cancel_grace_s`` later, SIGKILL to the process group. On a
thread it cancels the task's Spark job group, repeatedly every 0.5 s while the task runs,
because a job submitted just after a cancel (a query still being planned, an adaptive
query's next stage) is not covered by the earlier cancel. Thread code must cooperate
(``ctx.cancelled.wait``, ``ctx.check_cancelled()``); a thread that has not stopped
``cancel_grace_s`` after the cancel is reported as cancelled anyway and abandoned (it
keeps its pool slot until it returns: threads cannot be killed).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from clients.worker.artifacts import ArtifactCache
from clients.worker.config import WorkerConfig
from clients.worker.runtime.attempts import Running, TaskKey, attempt_fields, cancelled_report
from clients.worker.runtime.process_runs import (
    ProcessRunner,
    outcome_report,
    task_memory_limit_mb,
)
from clients.worker.runtime.thread_runs import ThreadRunner
from clients.worker.spark.tenant_servers import SparkBackend
from clients.worker.task_api import (
    BUILTIN_TASKS,
    TaskCancelled,
    TaskContext,
    TaskFn,
    encode_result,
    error_text,
    make_task_logger,
    shared_spark,
    spark_defaults,
)
from clients.worker.task_identity import TaskIdentities
from clients.worker.task_processes.pool import TaskProcessPool
from clients.worker.task_processes.process_handle import batched_writes
from wire.worker_protocol import AssignedTask, TaskAttempt, TaskReport

__all__ = [
    "BUILTIN_TASKS",
    "TaskCancelled",
    "TaskContext",
    "TaskFn",
    "TaskKey",
    "TaskRuntime",
    "encode_result",
    "error_text",
    "make_task_logger",
    "outcome_report",
    "released_notice",
    "shared_spark",
    "spark_defaults",
    "split_dropped_note",
    "stopping_notice",
    "task_memory_limit_mb",
]

logger = logging.getLogger("clients.worker.runtime")

# task_processes/pool.py puts this line before an attempt's output when it kept only the tail.
_DROPPED_NOTE = re.compile(rb"\A\[\.\.\. (\d{1,18}) earlier bytes of output dropped \.\.\.\]\n")


def stopping_notice(running: int, grace_s: float) -> None:
    """The one line a stopping worker says first: what it waits for, and for how long."""
    if running:
        what = (
            f"stopping: waiting for {running} running task{'s' if running != 1 else ''} to"
            f" finish (grace {grace_s:g} s, --stop-grace-s); then the rest go back to the"
            " broker for another worker. Ctrl-C again gives them back now"
        )
    else:
        what = "stopping: no tasks running"
    # Logged, not printed: under --log-format json every line stays one JSON object.
    logger.warning("%s", what)


def released_notice(count: int) -> None:
    """The line after the grace: how many attempts went back (not counted as failed)."""
    if count:
        logger.warning(
            "gave %d running task%s back to the broker: they wait for another worker (the"
            " attempt is not counted as failed)",
            count,
            "s" if count != 1 else "",
        )


def split_dropped_note(output: bytes) -> tuple[int, bytes]:
    """(offset of the first kept byte, the kept bytes) of an attempt's captured output."""
    match = _DROPPED_NOTE.match(output)
    if match is None:
        return 0, output
    return int(match.group(1)), output[match.end() :]


class TaskRuntime:
    """Starts, cancels and reports tasks. ``on_report`` is called from task threads.

    A task stays listed in :meth:`running` from :meth:`start` until :meth:`forget` (the
    link calls it once it holds the report), so a Hello built in between lists it.

    It holds the table of attempts and their reports; running them is its runners' work:
    :class:`ThreadRunner` (tasks on threads) and :class:`ProcessRunner` (tasks in task
    processes, with their slots), which share its lock and thread pool.
    """

    def __init__(
        self,
        config: WorkerConfig,
        on_report: Callable[[TaskReport], None],
        *,
        artifacts: ArtifactCache | None = None,
        spark_factory: Callable[[], Any] | None = None,
        spark_server: SparkBackend | None = None,
    ) -> None:
        self.config = config
        # The worker's Spark Connect server (--spark connect with task processes).
        self.spark_server = spark_server
        self._on_report = on_report
        self.artifacts = artifacts or ArtifactCache(
            config.cache_dir,
            config.http_url,
            token=config.token,
            timeout_s=config.download_timeout_s,
            ssl_context=config.ssl_context(),
            max_cache_bytes=config.max_cache_bytes,
        )
        self._spark_factory = spark_factory or (
            lambda: shared_spark(config.spark_master, config.spark_conf)
        )
        self._entries: dict[TaskKey, Running] = {}
        # Attempts known per task id, so a newer attempt finds older ones in O(1).
        self._attempts: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=config.capacity(), thread_name_prefix="steward-task"
        )
        self._closed = False
        self._threads = ThreadRunner(config, self.artifacts, self._finish)
        self._procs: ProcessRunner | None = None
        if config.task_isolation == "process":
            self._procs = ProcessRunner(
                config,
                self.artifacts,
                spark_server,
                lock=self._lock,
                pool=self._pool,
                finish=self._finish,
            )
        self.identities: TaskIdentities | None = (
            self._procs.identities if self._procs is not None else None
        )
        self.processes: TaskProcessPool | None = (
            self._procs.processes if self._procs is not None else None
        )

    def register(self, type_name: str, fn: TaskFn) -> None:
        """Add or replace a task type run in this process (the embedder's own code)."""
        self._threads.register(type_name, fn)

    def task_names(self) -> list[str]:
        """The task type names this worker runs besides ``module:function`` of code
        artifacts (built-in and registered), as its Hello lists them (docs/DESIGN.md §6,
        "Served task types"); register types before the worker connects."""
        return self._threads.task_names()

    def batched(self) -> contextlib.AbstractContextManager[None]:
        """Start several tasks inside: each task process gets its Runs in one write."""
        return batched_writes()

    def output(self, key: TaskKey) -> bytes | None:
        """The captured stdout/stderr of a recent attempt run in a task process."""
        return self._procs.output(key) if self._procs is not None else None

    def live_output(self, key: TaskKey, since: int = 0) -> tuple[int, bytes] | None:
        """(offset, bytes) of what a running attempt's task process wrote from offset
        ``since`` on (or from its first byte still held), or None (not running in a task
        process)."""
        with self._lock:  # entry.process is this attempt's until it is set back to None
            entry = self._entries.get(key)
            process = entry.process if entry is not None else None
            if process is None:
                return None
            return process.output_from(key, since)

    # -- queries (any thread) --

    def running(self) -> list[TaskAttempt]:
        with self._lock:
            return [TaskAttempt(*key) for key in self._entries]

    def older_attempts(self, task_id: int, attempt: int) -> list[TaskKey]:
        """Known attempts of ``task_id`` before ``attempt`` (superseded by it)."""
        with self._lock:
            return [(task_id, a) for a in self._attempts.get(task_id, ()) if a < attempt]

    def is_known(self, key: TaskKey) -> bool:
        with self._lock:
            return key in self._entries

    def busy_threads(self) -> int:
        """Known tasks whose code is still executing (an abandoned one drops out once reported)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.thread_done.is_set())

    def context(self, key: TaskKey) -> TaskContext | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.ctx if entry is not None else None

    # -- commands --

    def start(self, task: AssignedTask) -> bool:
        """Queue a task; False (and nothing done) if that attempt is already here."""
        key = (task.task_id, task.attempt)
        ctx = TaskContext(
            task,
            spark_factory=self._spark_factory,
            max_result_bytes=self.config.max_result_bytes,
            spark_unavailable=(
                "Spark is off on this worker (steward worker --spark off)"
                if self.config.spark == "off"
                else None
            ),
        )
        entry = Running(task, ctx)
        procs = self._procs
        entry.in_process = procs is not None and not self._threads.is_registered(task.type)
        with self._lock:
            if key in self._entries or self._closed:
                return False
            self._entries[key] = entry
            self._attempts.setdefault(key[0], set()).add(key[1])
            if procs is None or not entry.in_process:
                entry.future = self._pool.submit(self._threads.run, entry)
                return True
            if not procs.take_slot(entry):
                return True
        procs.begin(entry)
        return True

    def cancel(self, key: TaskKey, reason: str, *, report: bool = True) -> bool:
        """Stop a task; it reports ``cancelled: <reason>`` unless ``report`` is False."""
        procs = self._procs
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if not report:
                entry.suppress_report = True
            if entry.ctx.cancelled.is_set() or entry.reported:
                return True
            entry.ctx._cancel(reason)
            future = entry.future
            waiting = procs is not None and procs.unqueue(entry)
        if waiting:  # never begun: it held no slot
            entry.thread_done.set()
            self._finish(entry, cancelled_report(entry))
            return True
        if future is not None and future.cancel():  # still queued: it never ran
            entry.thread_done.set()
            self._finish(entry, cancelled_report(entry))
            if procs is not None and entry.in_process:
                procs.begin(procs.slot_freed())
            return True
        with self._lock:
            process = entry.process
        if process is not None:  # ended for sure: SIGTERM now, SIGKILL after the grace
            process.cancel(key, reason, self.config.cancel_grace_s)
            return True
        threading.Thread(
            target=self._threads.watch_cancelled,
            args=(entry,),
            name=f"steward-cancel-{key[0]}",
            daemon=True,
        ).start()
        return True

    def cancel_all(self, reason: str) -> None:
        with self._lock:
            keys = list(self._entries)
        for key in keys:
            self.cancel(key, reason)

    def release_all(self, reason: str) -> int:
        """Stop every running task and give its attempt back to the broker, which queues
        the task again without counting the attempt (the worker stops: docs/DESIGN.md §6,
        "Stopping"). Returns how many it gave back."""
        with self._lock:
            # One cancelled already (its deadline, the broker) ends as that cancel says.
            entries = [
                e for e in self._entries.values() if not e.reported and not e.ctx.cancelled.is_set()
            ]
            for entry in entries:
                entry.released = True
        for entry in entries:
            self.cancel((entry.task.task_id, entry.task.attempt), reason)
        return len(entries)

    def report_released(self) -> None:
        """Report every given-back attempt that has not ended yet as given back now: the
        worker is about to end its task processes, and the broker must not wait for them."""
        with self._lock:
            entries = [e for e in self._entries.values() if e.released and not e.reported]
        for entry in entries:
            self._finish(entry, cancelled_report(entry))

    def forget(self, key: TaskKey) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.reported:
                del self._entries[key]
                attempts = self._attempts.get(key[0])
                if attempts is not None:
                    attempts.discard(key[1])
                    if not attempts:
                        del self._attempts[key[0]]

    def shutdown(self, *, wait: bool = False) -> None:
        with self._lock:
            self._closed = True
            if self._procs is not None:
                self._procs.closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self._procs is not None:
            self._procs.close()
        self.artifacts.close()

    def _finish(self, entry: Running, report: TaskReport) -> None:
        key = (entry.task.task_id, entry.task.attempt)
        with self._lock:
            if entry.reported:
                return
            entry.reported = True
            suppress = entry.suppress_report
            if entry.released and not report.ok:
                reason = entry.ctx.cancel_reason or "worker stopping"
                report = msgspec.structs.replace(
                    report, released=True, error=f"given back: {reason}"
                )
        if suppress:
            self.forget(key)
            return
        try:
            self._on_report(report)
        except Exception:
            logger.exception(
                "delivering the report of task %d attempt %d failed",
                *key,
                extra=attempt_fields(entry),
            )
