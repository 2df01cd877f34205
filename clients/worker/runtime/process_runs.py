"""Tasks run in task processes: the process slots, sending a task to a process, and
turning the process's outcome into a report (see ``clients/worker/runtime/task_runtime.py``).

A task for a task process holds one of ``capacity()`` process slots from when it is begun
(preparing, sent, or running) until its report; more wait in order for a slot. When a
warm process of its tenant is idle and its code already copied, it is sent at once;
otherwise a thread of the runtime's pool downloads the code or starts a process first.
The pool's one dispatcher thread reads every process's pipes and calls
:meth:`ProcessRunner._on_outcome`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Literal

from clients.worker.artifacts import ArtifactCache
from clients.worker.config import WorkerConfig
from clients.worker.runtime.attempts import Running, TaskKey, attempt_fields, cancelled_report
from clients.worker.spark.connect_server import (
    SparkConnectError,
    new_session_id,
)
from clients.worker.spark.pools import pool_name
from clients.worker.spark.remote import RemoteSpark
from clients.worker.spark.tenant_servers import SparkBackend, TenantSparkServers
from clients.worker.task_api import (
    BUILTIN_TASKS,
    MAX_ERROR_CHARS,
    TaskContext,
    error_text,
    task_logger_parent,
)
from clients.worker.task_env import WorkArea
from clients.worker.task_identity import TaskIdentity
from clients.worker.task_processes import pipe_protocol
from clients.worker.task_processes.pool import PoolLimits, TaskProcessPool, task_identities
from clients.worker.task_processes.process_handle import Outcome, TaskProcess
from wire.worker_protocol import AssignedTask, TaskReport

# One logger for all of the runtime's parts (operators filter on this name).
logger = logging.getLogger("clients.worker.runtime")

_KEPT_OUTPUTS: Final = 256  # attempts whose captured output the worker keeps


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


class ProcessRunner:
    """The task processes' side of the runtime. ``lock`` is the runtime's: it guards the
    slots, the waiting queue, ``closed``, each attempt's ``process`` and the kept output.
    ``finish`` takes each attempt's report; ``pool`` runs the preparations."""

    def __init__(
        self,
        config: WorkerConfig,
        artifacts: ArtifactCache,
        spark_server: SparkBackend | None,
        *,
        lock: threading.Lock,
        pool: ThreadPoolExecutor,
        finish: Callable[[Running, TaskReport], None],
    ) -> None:
        self.config = config
        self.artifacts = artifacts
        self.spark_server = spark_server
        self._lock = lock
        self._pool = pool
        self._finish = finish
        self.identities = task_identities(config)
        self.processes = TaskProcessPool(
            PoolLimits(
                capacity=config.capacity(),
                idle_s=config.task_process_idle_s,
                max_tasks=config.task_process_max_tasks,
                max_rss_mb=config.task_process_max_rss_mb,
                max_output_bytes=config.max_output_bytes,
                max_frame_bytes=2 * config.max_result_bytes + 1024 * 1024,
                # A spare per tenant whose Spark server may be warm (task_processes/pool.py,
                # "Spares").
                max_spares=(
                    config.spark_max_servers if isinstance(spark_server, TenantSparkServers) else 0
                ),
                spare_idle_s=config.spark_server_idle_s,
            ),
            WorkArea(config.work_dir),
            python=config.task_python,
            preload_spark=spark_server is not None,
        )
        # (sha256, uid) -> the verified copy that uid's task processes import.
        self._code_copies: dict[tuple[str, int], Path] = {}
        # Captured output of the latest attempts run in task processes (bounded).
        self._outputs: OrderedDict[TaskKey, bytes] = OrderedDict()
        # Process tasks begun (preparing, sent, or running) and those waiting for a slot:
        # at most capacity() at once, as the thread pool bounds thread tasks.
        self._process_tasks = 0
        self._waiting: deque[Running] = deque()
        # Attempts holding their tenant's Spark server (per-tenant servers) -> the tenant.
        self._spark_holds: dict[TaskKey, str] = {}
        self.closed = False  # set by the runtime's shutdown: waiting tasks stay unbegun

    # -- slots (the caller holds the lock) --

    def take_slot(self, entry: Running) -> bool:
        """A slot for ``entry`` (True: begin it), or False: it waits for one."""
        if self._process_tasks >= self.config.capacity():
            self._waiting.append(entry)
            return False
        self._process_tasks += 1
        return True

    def unqueue(self, entry: Running) -> bool:
        """Take ``entry`` out of the waiting queue; False: it was not waiting."""
        if entry in self._waiting:
            self._waiting.remove(entry)
            return True
        return False

    # -- output --

    def output(self, key: TaskKey) -> bytes | None:
        with self._lock:
            return self._outputs.get(key)

    def close(self) -> None:
        self.processes.close()

    # -- running --

    def begin(self, entry: Running | None) -> None:
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

    def _prepare_and_dispatch(self, entry: Running) -> None:
        sent = self._dispatch(entry, wait=True)
        if sent is not True and sent is not False:
            self.begin(self._end_process_task(entry, sent))

    def slot_freed(self) -> Running | None:
        """A slot was freed: the waiting task it passes to, or None (the slot is free)."""
        with self._lock:
            if self._waiting and not self.closed:
                return self._waiting.popleft()
            self._process_tasks -= 1
            return None

    def _end_process_task(self, entry: Running, report: TaskReport) -> Running | None:
        entry.thread_done.set()
        self._finish(entry, report)
        return self.slot_freed()

    def _dispatch(self, entry: Running, *, wait: bool) -> bool | TaskReport:
        """Send a task to a task process; True when sent (its outcome arrives in
        :meth:`_on_outcome`), or the report of a task that cannot be sent.

        ``wait`` False (on the caller's thread): only with a warm process and code already
        copied, else False and nothing done. ``wait`` True (on a pool thread): downloads
        code and starts a process as needed.
        """
        task, ctx = entry.task, entry.ctx
        pool, identities = self.processes, self.identities
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
                return cancelled_report(entry)
            ctx.logger.info("task %d attempt %d failed: %s", task.task_id, task.attempt, exc)
            return TaskReport(task.task_id, task.attempt, ok=False, error=error_text(exc))
        with self._lock:
            entry.process = process
            cancelled = ctx.cancelled.is_set()
        if cancelled:  # cancel() came before the process was known: it never ran
            with self._lock:
                entry.process = None
            pool.unclaim(process)
            return cancelled_report(entry)
        run = pipe_protocol.Run(
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
            **self._spark_fields(task.tenant),
        )
        if task_logger_parent.isEnabledFor(logging.DEBUG):  # a task's logger costs a no-op task
            ctx.logger.debug(
                "task %d attempt %d running (%s) in process %d",
                task.task_id,
                task.attempt,
                task.type,
                process.pid,
            )
        process.start_run(
            run,
            lambda outcome: self._on_outcome(entry, process, run, outcome),
            entry.ctx._record_progress,
            (lambda: self._spark_wanted(entry, process)) if run.spark_on_request else None,
        )
        return True

    def _spark_wanted(self, entry: Running, process: TaskProcess) -> None:
        """The running task's ctx.spark asked for its tenant's server (on the dispatcher's
        thread: the start and the wait go to a thread of their own)."""
        threading.Thread(
            target=self._grant_spark, args=(entry, process), name="steward-spark-grant", daemon=True
        ).start()

    def _grant_spark(self, entry: Running, process: TaskProcess) -> None:
        """Hold the tenant's server for the attempt (until its outcome) and tell the process
        where it is, once it is up; or why there is none."""
        servers = self.spark_server
        task = entry.task
        key = (task.task_id, task.attempt)
        try:
            if not isinstance(servers, TenantSparkServers):
                raise SparkConnectError("this worker has no per-tenant Spark servers")
            server = servers.acquire(task.tenant, process.identity, servers.busy_wait_s)
        except Exception as exc:
            process.send_spark_granted(
                pipe_protocol.SparkGranted(task.task_id, task.attempt, error=str(exc))
            )
            return
        with self._lock:
            running = entry.process is process
            if running:
                self._spark_holds[key] = task.tenant
        if not running:  # the attempt ended while its server was found
            servers.release(task.tenant)
            return
        try:
            endpoint = server.wait_ready(servers.start_timeout_s)
            granted = pipe_protocol.SparkGranted(
                task.task_id, task.attempt, endpoint.port, endpoint.token, endpoint.uid
            )
        except SparkConnectError as exc:
            granted = pipe_protocol.SparkGranted(task.task_id, task.attempt, error=str(exc))
        process.send_spark_granted(granted)
        if not granted.error:  # the tenant's next task in a new process: no imports to wait for
            self.processes.keep_spare(task.tenant, process.identity)

    def _on_outcome(
        self, entry: Running, process: TaskProcess, run: pipe_protocol.Run, outcome: Outcome
    ) -> None:
        """A task process's Done or end, on the dispatcher's thread (or the canceller's, for
        a task cancelled while queued): must not block."""
        task, ctx = entry.task, entry.ctx
        pool = self.processes
        with self._lock:
            entry.process = None
            spark_held = self._spark_holds.pop((task.task_id, task.attempt), None)
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
            self.begin(entry)
            return
        self._keep_output((task.task_id, task.attempt), outcome.output)
        if run.spark_session_id and not skipped and (ctx.cancelled.is_set() or done is None):
            # Its process stopped, maybe not its queries on the server (released after).
            self._interrupt_spark_session(entry, run.spark_session_id, spark_held)
        elif spark_held is not None:
            self._release_spark(spark_held)
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
            report = cancelled_report(entry, note)
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
        self.begin(self._end_process_task(entry, report))

    def _spark_fields(self, tenant: str) -> dict[str, Any]:
        """The Run's Spark fields: the mode, and with Connect the server and a new session id."""
        mode = self.config.spark
        server = self.spark_server
        if mode != "connect":
            return {"spark_mode": mode}
        if server is None:
            return {"spark_mode": mode, "spark_error": "this worker has no Spark Connect server"}
        pool = pool_name(tenant) or ""
        if isinstance(server, TenantSparkServers):
            # The tenant's own server, asked for on first use of ctx.spark; no pools: the
            # server is the tenant's alone (docs/DESIGN.md §6).
            return {
                "spark_mode": mode,
                "spark_on_request": True,
                "spark_session_id": new_session_id(),
                "spark_wait_s": server.wait_left_s(),
            }
        if isinstance(server, RemoteSpark):
            return {
                "spark_mode": mode,
                "spark_remote": server.url,
                "spark_session_id": new_session_id(),
                "spark_wait_s": server.wait_left_s(),
                "spark_pool": pool,
            }
        endpoint = server.endpoint
        return {
            "spark_mode": mode,
            "spark_pool": pool,
            "spark_connect_port": endpoint.port,
            "spark_connect_token": endpoint.token,
            "spark_connect_uid": endpoint.uid,
            "spark_session_id": new_session_id(),
            "spark_wait_s": server.wait_left_s(),
            "spark_error": server.error() or "",
        }

    def _release_spark(self, tenant: str) -> None:
        if isinstance(self.spark_server, TenantSparkServers):
            self.spark_server.release(tenant)
            # The server's idle time starts now: the tenant's spare's too.
            self.processes.keep_spare(tenant, self.identities.for_tenant(tenant))

    def _interrupt_spark_session(
        self, entry: Running, session_id: str, spark_held: str | None
    ) -> None:
        """The task's process is gone, not its queries: interrupt them on the server (from a
        thread of its own, so the report does not wait for the server)."""
        server = self.spark_server
        if server is None:
            return
        if isinstance(server, TenantSparkServers) and spark_held is None:
            return  # it never asked for its tenant's server: no session there

        def interrupt() -> None:
            try:
                if isinstance(server, TenantSparkServers):
                    server.interrupt(entry.task.tenant, session_id)
                else:
                    server.interrupt(session_id)
            except Exception as exc:
                logger.warning(
                    "could not interrupt the Spark session of task %d attempt %d: %s",
                    entry.task.task_id,
                    entry.task.attempt,
                    exc,
                    extra=attempt_fields(entry),
                )
            finally:
                if spark_held is not None:
                    self._release_spark(spark_held)

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
