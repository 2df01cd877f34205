"""Tasks run on the worker's own threads: types the embedding program registered, and
everything with ``task_isolation="thread"`` (see ``clients/worker/runtime/task_runtime.py``).

A cancel of a task on a thread cancels its Spark job group, again every 0.5 s while the
task runs (a job submitted just after a cancel is not covered by the earlier one); a
thread still running ``cancel_grace_s`` after the cancel is reported cancelled and
abandoned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from clients.worker.artifacts import ArtifactCache
from clients.worker.config import WorkerConfig
from clients.worker.runtime.attempts import Running, attempt_fields, cancelled_report
from clients.worker.task_api import BUILTIN_TASKS, TaskFn, call_task, error_text
from wire.worker_protocol import AssignedTask, TaskReport

# One logger for all of the runtime's parts (operators filter on this name).
logger = logging.getLogger("clients.worker.runtime")

_SPARK_RECANCEL_S: Final = 0.5


class ThreadRunner:
    """Runs attempts on pool threads and watches cancelled ones; ``finish`` takes each
    attempt's report (at most once per attempt: the runtime checks)."""

    def __init__(
        self,
        config: WorkerConfig,
        artifacts: ArtifactCache,
        finish: Callable[[Running, TaskReport], None],
    ) -> None:
        self.config = config
        self.artifacts = artifacts
        self._finish = finish
        self._registry: dict[str, TaskFn] = dict(BUILTIN_TASKS)
        # Types the embedding program registered: its own code, run in this process.
        self._registered: set[str] = set()

    def register(self, type_name: str, fn: TaskFn) -> None:
        self._registry[type_name] = fn
        self._registered.add(type_name)

    def is_registered(self, type_name: str) -> bool:
        return type_name in self._registered

    def task_names(self) -> list[str]:
        """The plain type names this worker runs: the built-in and the registered ones."""
        return sorted(self._registry)

    def run(self, entry: Running) -> None:
        """A pool thread's work: run the attempt, then hand over its report."""
        try:
            report = self._execute(entry)
        finally:
            entry.ctx._leave_job_group()
            entry.thread_done.set()
        self._finish(entry, report)

    def _execute(self, entry: Running) -> TaskReport:
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
                return cancelled_report(entry)
            ctx.logger.info("task %d attempt %d failed: %r", task.task_id, task.attempt, exc)
            return TaskReport(task.task_id, task.attempt, ok=False, error=error_text(exc))
        ctx.logger.debug("task %d attempt %d finished", task.task_id, task.attempt)
        return TaskReport(task.task_id, task.attempt, ok=True, result=result, spawn=ctx.spawned)

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

    def watch_cancelled(self, entry: Running) -> None:
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
                        extra=attempt_fields(entry),
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
            extra=attempt_fields(entry),
        )
        self._finish(
            entry,
            cancelled_report(
                entry, f" (the task did not stop within {self.config.cancel_grace_s:g} s)"
            ),
        )
