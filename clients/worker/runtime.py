"""The task runtime: runs assigned tasks and turns their outcomes into reports.

A task type names a callable ``fn(params, ctx)``: one of the built-ins (``noop``,
``sleep``, ``fail``, ``spark.sql``), one registered with :meth:`TaskRuntime.register`, or
``module:function`` from the task's code artifact. ``params`` is the decoded JSON;
``ctx`` is a :class:`TaskContext` (``clients/worker/task_api.py``). The return value
becomes the task's JSON result.

Where tasks run. With ``task_isolation="process"`` (the default) the built-in types and
every code artifact, i.e. everything a tenant supplies, run in task processes
(``clients/worker/task_procs.py``): one tenant per process, under a uid that is not the
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
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from broker.observability.logs import task_fields
from broker.workers.protocol import AssignedTask, TaskAttempt, TaskReport
from clients.worker import task_wire
from clients.worker.artifacts import ArtifactCache
from clients.worker.config import WorkerConfig
from clients.worker.spark_connect import (
    SparkConnectServer,
    new_session_id,
    tenant_uid_range,
)
from clients.worker.task_api import (
    BUILTIN_TASKS,
    MAX_ERROR_CHARS,
    TaskCancelled,
    TaskContext,
    TaskFn,
    call_task,
    encode_result,
    error_text,
    make_task_logger,
    shared_spark,
    spark_defaults,
    task_logger_parent,
)
from clients.worker.task_env import WorkArea
from clients.worker.task_identity import TaskIdentities, TaskIdentity
from clients.worker.task_process import Outcome, TaskProcess, batched_writes
from clients.worker.task_procs import PoolLimits, TaskProcessPool

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
    "shared_spark",
    "spark_defaults",
]

logger = logging.getLogger(__name__)

TaskKey = tuple[int, int]  # (task_id, attempt)

_SPARK_RECANCEL_S: Final = 0.5
_KEPT_OUTPUTS: Final = 256  # attempts whose captured output the worker keeps
# task_procs.py puts this line before an attempt's output when it kept only the tail.
_DROPPED_NOTE = re.compile(rb"\A\[\.\.\. (\d{1,18}) earlier bytes of output dropped \.\.\.\]\n")


def split_dropped_note(output: bytes) -> tuple[int, bytes]:
    """(offset of the first kept byte, the kept bytes) of an attempt's captured output."""
    match = _DROPPED_NOTE.match(output)
    if match is None:
        return 0, output
    return int(match.group(1)), output[match.end() :]


def task_identities(config: WorkerConfig) -> TaskIdentities:
    """Who runs each tenant's task processes (TaskUserError when the config is unusable)."""
    return TaskIdentities(
        task_user=config.task_user,
        tenant_users=config.tenant_users,
        uid_range=tenant_uid_range(config),
        allow_root=config.allow_root_tasks,
    )


def task_memory_limit_mb(task: AssignedTask, default_mb: int) -> int:
    """The task's ``resources.memory_mb`` when given, else the worker's default (0: none)."""
    asked = task.resources.get("memory_mb")
    if asked is not None and asked > 0:
        return max(1, int(asked))
    return default_mb


def outcome_report(
    task: AssignedTask, outcome: Outcome, memory_mb: int, max_result_bytes: int
) -> TaskReport:
    """The report of a task process's outcome; checks what the (untrusted) process sent."""
    done = outcome.done
    if done is None:
        error = f"the task's process {outcome.exit_description}"
        return TaskReport(task.task_id, task.attempt, ok=False, error=error)
    if not done.ok:
        error = (done.error or "failed")[:MAX_ERROR_CHARS]
        if done.out_of_memory and memory_mb:
            error = f"killed: memory limit {memory_mb} MB\n\n{error}"
        return TaskReport(task.task_id, task.attempt, ok=False, error=error)
    # Sizes only: they keep the Finish frame within the link's bound. Whether the result is
    # JSON and the spawns valid, the broker checks for every worker
    # (broker/workers/finish_reports.py).
    problem = ""
    if done.result is None or len(done.result) > max_result_bytes:
        problem = "result missing or over max_result_bytes"
    elif len(done.spawn) > TaskContext.MAX_SPAWNS or (
        sum(len(s.params) for s in done.spawn) > max_result_bytes
    ):
        problem = "too many or too large spawn requests"
    if problem:
        error = f"the task's process sent a bad result: {problem}"
        return TaskReport(task.task_id, task.attempt, ok=False, error=error)
    return TaskReport(task.task_id, task.attempt, ok=True, result=done.result, spawn=done.spawn)


def _fields(entry: _Running) -> dict[str, Any]:
    task = entry.task
    return task_fields(task.task_id, task.tenant, attempt=task.attempt)


@dataclass
class _Running:
    task: AssignedTask
    ctx: TaskContext
    future: Future[None] | None = None
    thread_done: threading.Event = field(default_factory=threading.Event)
    reported: bool = False
    suppress_report: bool = False
    process: TaskProcess | None = None  # the task process running it, if any
    in_process: bool = False  # run in a task process (holds a process slot once begun)


class TaskRuntime:
    """Starts, cancels and reports tasks. ``on_report`` is called from task threads.

    A task stays listed in :meth:`running` from :meth:`start` until :meth:`forget` (the
    link calls it once it holds the report), so a Hello built in between lists it.
    """

    def __init__(
        self,
        config: WorkerConfig,
        on_report: Callable[[TaskReport], None],
        *,
        artifacts: ArtifactCache | None = None,
        spark_factory: Callable[[], Any] | None = None,
        spark_server: SparkConnectServer | None = None,
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
        )
        self._spark_factory = spark_factory or (
            lambda: shared_spark(config.spark_master, config.spark_conf)
        )
        self._registry: dict[str, TaskFn] = dict(BUILTIN_TASKS)
        # Types the embedding program registered: its own code, run in this process.
        self._registered: set[str] = set()
        self.identities: TaskIdentities | None = None
        self.processes: TaskProcessPool | None = None
        if config.task_isolation == "process":
            self.identities = task_identities(config)
            self.processes = TaskProcessPool(
                PoolLimits(
                    capacity=config.capacity(),
                    idle_s=config.task_process_idle_s,
                    max_tasks=config.task_process_max_tasks,
                    max_rss_mb=config.task_process_max_rss_mb,
                    max_output_bytes=config.max_output_bytes,
                    max_frame_bytes=2 * config.max_result_bytes + 1024 * 1024,
                ),
                WorkArea(config.work_dir),
                python=config.task_python,
                preload_spark=spark_server is not None,
            )
        # (sha256, uid) -> the verified copy that uid's task processes import.
        self._code_copies: dict[tuple[str, int], Path] = {}
        # Captured output of the latest attempts run in task processes (bounded).
        self._outputs: OrderedDict[TaskKey, bytes] = OrderedDict()
        self._entries: dict[TaskKey, _Running] = {}
        # Process tasks begun (preparing, sent, or running) and those waiting for a slot:
        # at most capacity() at once, as the thread pool bounds thread tasks.
        self._process_tasks = 0
        self._waiting: deque[_Running] = deque()
        # Attempts known per task id, so a newer attempt finds older ones in O(1).
        self._attempts: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=config.capacity(), thread_name_prefix="steward-task"
        )
        self._closed = False

    def register(self, type_name: str, fn: TaskFn) -> None:
        """Add or replace a task type run in this process (the embedder's own code)."""
        self._registry[type_name] = fn
        self._registered.add(type_name)

    def batched(self) -> contextlib.AbstractContextManager[None]:
        """Start several tasks inside: each task process gets its Runs in one write."""
        return batched_writes()

    def output(self, key: TaskKey) -> bytes | None:
        """The captured stdout/stderr of a recent attempt run in a task process."""
        with self._lock:
            return self._outputs.get(key)

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
        entry = _Running(task, ctx)
        entry.in_process = self.processes is not None and task.type not in self._registered
        with self._lock:
            if key in self._entries or self._closed:
                return False
            self._entries[key] = entry
            self._attempts.setdefault(key[0], set()).add(key[1])
            if not entry.in_process:
                entry.future = self._pool.submit(self._run, entry)
                return True
            if self._process_tasks >= self.config.capacity():
                self._waiting.append(entry)
                return True
            self._process_tasks += 1
        self._begin_process_tasks(entry)
        return True

    def cancel(self, key: TaskKey, reason: str, *, report: bool = True) -> bool:
        """Stop a task; it reports ``cancelled: <reason>`` unless ``report`` is False."""
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
            waiting = entry in self._waiting
            if waiting:
                self._waiting.remove(entry)
        if waiting:  # never begun: it held no slot
            entry.thread_done.set()
            self._finish(entry, self._cancelled_report(entry))
            return True
        if future is not None and future.cancel():  # still queued: it never ran
            entry.thread_done.set()
            self._finish(entry, self._cancelled_report(entry))
            if entry.in_process:
                self._begin_process_tasks(self._next_process_task())
            return True
        with self._lock:
            process = entry.process
        if process is not None:  # ended for sure: SIGTERM now, SIGKILL after the grace
            process.cancel(key, reason, self.config.cancel_grace_s)
            return True
        threading.Thread(
            target=self._watch_cancelled,
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
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()
        self.artifacts.close()

    # -- task threads --

    def _run(self, entry: _Running) -> None:
        try:
            report = self._execute(entry)
        finally:
            entry.ctx._leave_job_group()
            entry.thread_done.set()
        self._finish(entry, report)

    def _execute(self, entry: _Running) -> TaskReport:
        task, ctx = entry.task, entry.ctx
        # DEBUG: one line per task at full rate would flood the log; failures are INFO.
        ctx.logger.debug("task %d attempt %d running (%s)", task.task_id, task.attempt, task.type)
        try:
            result = call_task(
                ctx, task.params, lambda: self._resolve(task), self.config.max_result_bytes
            )
        except BaseException as exc:  # every failure of task code (even SystemExit) is a report
            if ctx.cancelled.is_set():
                ctx.logger.info(
                    "task %d attempt %d cancelled: %s",
                    task.task_id,
                    task.attempt,
                    ctx.cancel_reason or "cancelled",
                )
                return self._cancelled_report(entry)
            ctx.logger.info("task %d attempt %d failed: %r", task.task_id, task.attempt, exc)
            return TaskReport(task.task_id, task.attempt, ok=False, error=error_text(exc))
        ctx.logger.debug("task %d attempt %d finished", task.task_id, task.attempt)
        return TaskReport(task.task_id, task.attempt, ok=True, result=result, spawn=ctx.spawned)

    # -- task processes --

    def _begin_process_tasks(self, entry: _Running | None) -> None:
        """Send ``entry`` (which holds a process slot), then the waiting tasks its slot
        passes to if it fails at once; a loop, not recursion: thousands may fail in a row."""
        while entry is not None:
            sent = self._dispatch(entry, wait=False)
            if sent is True:
                return
            if sent is False:  # needs a download or a new process: a pool thread does that
                with self._lock:
                    entry.future = self._pool.submit(self._prepare_and_dispatch, entry)
                return
            entry = self._end_process_task(entry, sent)

    def _prepare_and_dispatch(self, entry: _Running) -> None:
        sent = self._dispatch(entry, wait=True)
        if sent is not True and sent is not False:
            self._begin_process_tasks(self._end_process_task(entry, sent))

    def _next_process_task(self) -> _Running | None:
        """A slot was freed: the waiting task it passes to, or None (the slot is free)."""
        with self._lock:
            if self._waiting and not self._closed:
                return self._waiting.popleft()
            self._process_tasks -= 1
            return None

    def _end_process_task(self, entry: _Running, report: TaskReport) -> _Running | None:
        entry.thread_done.set()
        self._finish(entry, report)
        return self._next_process_task()

    def _dispatch(self, entry: _Running, *, wait: bool) -> bool | TaskReport:
        """Send a task to a task process; True when sent (its outcome arrives in
        :meth:`_on_outcome`), or the report of a task that cannot be sent.

        ``wait`` False (on the caller's thread): only with a warm process and code already
        copied, else False and nothing done. ``wait`` True (on a pool thread): downloads
        code and starts a process as needed.
        """
        task, ctx = entry.task, entry.ctx
        pool, identities = self.processes, self.identities
        assert pool is not None and identities is not None
        try:
            ctx.check_cancelled()
            identity = identities.for_tenant(task.tenant)
            code_path = self._code_for_process(task, identity, pool, wait=wait)
            if code_path is False:
                return False
            memory_mb = task_memory_limit_mb(task, self.config.task_memory_mb)
            if wait:
                process = pool.acquire(task.tenant, memory_mb, identity)
            else:
                found = pool.pipeline_process(
                    task.tenant, memory_mb, task.type
                ) or pool.idle_process(task.tenant, memory_mb)
                if found is None:
                    return False
                process = found
        except BaseException as exc:
            if ctx.cancelled.is_set():
                return self._cancelled_report(entry)
            ctx.logger.info("task %d attempt %d failed: %s", task.task_id, task.attempt, exc)
            return TaskReport(task.task_id, task.attempt, ok=False, error=error_text(exc))
        with self._lock:
            entry.process = process
            cancelled = ctx.cancelled.is_set()
        if cancelled:  # cancel() came before the process was known: it never ran
            with self._lock:
                entry.process = None
            pool.unclaim(process)
            return self._cancelled_report(entry)
        run = task_wire.Run(
            task_id=task.task_id,
            attempt=task.attempt,
            tenant=task.tenant,
            type=task.type,
            params=task.params,
            workdir=process.workdir,
            max_result_bytes=self.config.max_result_bytes,
            code=task.code,
            code_path=str(code_path) if code_path is not None else None,
            deadline_ms=task.deadline_ms,
            resources=dict(task.resources),
            spark_master=self.config.spark_master,
            spark_conf=dict(self.config.spark_conf),
            allow_classic_spark=self.config.allow_classic_spark or self.config.spark == "classic",
            **self._spark_fields(),
        )
        if task_logger_parent.isEnabledFor(logging.DEBUG):  # a task's logger costs a no-op task
            ctx.logger.debug(
                "task %d attempt %d running (%s) in process %d",
                task.task_id,
                task.attempt,
                task.type,
                process.pid,
            )
        process.start_run(run, lambda outcome: self._on_outcome(entry, process, run, outcome))
        return True

    def _on_outcome(
        self, entry: _Running, process: TaskProcess, run: task_wire.Run, outcome: Outcome
    ) -> None:
        """A task process's Done or end, on the dispatcher's thread (or the canceller's, for
        a task cancelled while queued): must not block."""
        task, ctx = entry.task, entry.ctx
        pool = self.processes
        assert pool is not None
        with self._lock:
            entry.process = None
        done = outcome.done
        skipped = outcome.skipped or (done is not None and done.skipped)
        # A task's exception leaves its process fit for the next task; a cancel (of a task
        # that ran), a crash or exhausted memory does not.
        retire = not skipped and (ctx.cancelled.is_set() or done is None or done.out_of_memory)
        pool.release(process, retire=retire)
        if done is not None and not skipped:
            pool.note_run_time(task.tenant, task.type, done.elapsed_us)
        if outcome.not_started and not skipped and not ctx.cancelled.is_set():
            # Queued behind a task whose process ended: it never ran, send it elsewhere
            # (it keeps its slot).
            self._begin_process_tasks(entry)
            return
        self._keep_output((task.task_id, task.attempt), outcome.output)
        if run.spark_session_id and not skipped and (ctx.cancelled.is_set() or done is None):
            # Its process stopped, maybe not its queries on the server.
            self._interrupt_spark_session(entry, run.spark_session_id)
        if ctx.cancelled.is_set() or skipped:
            note = ""
            if outcome.killed:
                note = (
                    f" (the task did not stop within {self.config.cancel_grace_s:g} s;"
                    " its process was killed)"
                )
            ctx.logger.info(
                "task %d attempt %d cancelled: %s%s",
                task.task_id,
                task.attempt,
                ctx.cancel_reason or "cancelled",
                note,
            )
            report = self._cancelled_report(entry, note)
        else:
            memory_mb = task_memory_limit_mb(task, self.config.task_memory_mb)
            report = outcome_report(task, outcome, memory_mb, self.config.max_result_bytes)
            if not report.ok:
                ctx.logger.info(
                    "task %d attempt %d failed: %s",
                    task.task_id,
                    task.attempt,
                    (report.error or "").split("\n", 1)[0],
                )
        self._begin_process_tasks(self._end_process_task(entry, report))

    def _spark_fields(self) -> dict[str, Any]:
        """The Run's Spark fields: the mode, and with Connect the server and a new session id."""
        mode = self.config.spark
        server = self.spark_server
        if mode != "connect":
            return {"spark_mode": mode}
        if server is None:
            return {"spark_mode": mode, "spark_error": "this worker has no Spark Connect server"}
        endpoint = server.endpoint
        return {
            "spark_mode": mode,
            "spark_connect_port": endpoint.port,
            "spark_connect_token": endpoint.token,
            "spark_connect_uid": endpoint.uid,
            "spark_session_id": new_session_id(),
            "spark_wait_s": server.wait_left_s(),
            "spark_error": server.error() or "",
        }

    def _interrupt_spark_session(self, entry: _Running, session_id: str) -> None:
        """The task's process is gone, not its queries: interrupt them on the server (from a
        thread of its own, so the report does not wait for the server)."""
        server = self.spark_server
        if server is None:
            return

        def interrupt() -> None:
            try:
                server.interrupt(session_id)
            except Exception as exc:
                logger.warning(
                    "could not interrupt the Spark session of task %d attempt %d: %s",
                    entry.task.task_id,
                    entry.task.attempt,
                    exc,
                    extra=_fields(entry),
                )

        threading.Thread(target=interrupt, name="steward-spark-interrupt", daemon=True).start()

    def _code_for_process(
        self, task: AssignedTask, identity: TaskIdentity, pool: TaskProcessPool, *, wait: bool
    ) -> Path | Literal[False] | None:
        """The code copy the process imports (None: a built-in type); False: not ready
        and ``wait`` is False."""
        if task.type in BUILTIN_TASKS:
            return None
        if ":" not in task.type:
            raise LookupError(
                f"unknown task type {task.type!r}: not one of {', '.join(sorted(BUILTIN_TASKS))}"
                " and not 'module:function' with a code artifact"
            )
        if task.code is None:
            raise LookupError(f"task type {task.type!r} needs a code artifact (none given)")
        key = (task.code, identity.uid)
        copy = self._code_copies.get(key)
        if copy is None:  # verified once per worker process, then trusted
            if not wait:
                return False
            verified = self.artifacts.verified_copy(task.code)
            copy = pool.work.code_copy(task.code, verified, identity)
            self._code_copies[key] = copy
        return copy

    def _keep_output(self, key: TaskKey, output: bytes) -> None:
        with self._lock:
            self._outputs[key] = output
            self._outputs.move_to_end(key)
            while len(self._outputs) > _KEPT_OUTPUTS:
                self._outputs.popitem(last=False)

    def _resolve(self, task: AssignedTask) -> TaskFn:
        fn = self._registry.get(task.type)
        if fn is not None:
            return fn
        if ":" in task.type:
            if task.code is None:
                raise LookupError(f"task type {task.type!r} needs a code artifact (none given)")
            return self.artifacts.resolve(task.code, task.type)
        raise LookupError(
            f"unknown task type {task.type!r}: not one of {', '.join(sorted(self._registry))}"
            " and not 'module:function' with a code artifact"
        )

    @staticmethod
    def _cancelled_report(entry: _Running, note: str = "") -> TaskReport:
        reason = entry.ctx.cancel_reason or "cancelled"
        return TaskReport(
            entry.task.task_id, entry.task.attempt, ok=False, error=f"cancelled: {reason}{note}"
        )

    def _watch_cancelled(self, entry: _Running) -> None:
        """Keep cancelling the task's Spark jobs until it stops; give up after the grace."""
        deadline = time.monotonic() + self.config.cancel_grace_s
        while True:
            if entry.ctx.uses_spark:
                try:
                    entry.ctx._cancel_spark()
                except Exception:
                    logger.warning(
                        "cancelling Spark jobs of task %s failed",
                        entry.ctx.job_group,
                        extra=_fields(entry),
                    )
            left = deadline - time.monotonic()
            if entry.thread_done.wait(max(0.0, min(_SPARK_RECANCEL_S, left))):
                return
            if time.monotonic() >= deadline:
                break
        logger.warning(
            "task %d attempt %d ignored its cancel for %.1f s; reporting it cancelled and"
            " abandoning its thread",
            entry.task.task_id,
            entry.task.attempt,
            self.config.cancel_grace_s,
            extra=_fields(entry),
        )
        self._finish(
            entry,
            self._cancelled_report(
                entry, f" (the task did not stop within {self.config.cancel_grace_s:g} s)"
            ),
        )

    def _finish(self, entry: _Running, report: TaskReport) -> None:
        key = (entry.task.task_id, entry.task.attempt)
        with self._lock:
            if entry.reported:
                return
            entry.reported = True
            suppress = entry.suppress_report
        if suppress:
            self.forget(key)
            return
        try:
            self._on_report(report)
        except Exception:
            logger.exception(
                "delivering the report of task %d attempt %d failed", *key, extra=_fields(entry)
            )
