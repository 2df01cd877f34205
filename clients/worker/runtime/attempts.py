"""An attempt the task runtime holds, and the report of a cancelled one.

Shared by the runtime (``clients/worker/runtime/task_runtime.py``) and its two runners: tasks on
threads (``clients/worker/runtime/thread_runs.py``) and tasks in task processes
(``clients/worker/runtime/process_runs.py``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from broker.observability.logs import task_fields
from clients.worker.task_api import TaskContext
from clients.worker.task_processes.process_handle import TaskProcess
from wire.worker_protocol import AssignedTask, TaskReport

TaskKey = tuple[int, int]  # (task_id, attempt)


@dataclass
class Running:
    task: AssignedTask
    ctx: TaskContext
    future: Future[None] | None = None
    thread_done: threading.Event = field(default_factory=threading.Event)
    reported: bool = False
    suppress_report: bool = False
    process: TaskProcess | None = None  # the task process running it, if any
    in_process: bool = False  # run in a task process (holds a process slot once begun)
    # Cancelled because the worker stops: its report gives the attempt back (uncounted).
    released: bool = False


def attempt_fields(entry: Running) -> dict[str, Any]:
    """The structured-log fields of an attempt."""
    task = entry.task
    return task_fields(task.task_id, task.tenant, attempt=task.attempt)


def cancelled_report(entry: Running, note: str = "") -> TaskReport:
    reason = entry.ctx.cancel_reason or "cancelled"
    return TaskReport(
        entry.task.task_id, entry.task.attempt, ok=False, error=f"cancelled: {reason}{note}"
    )
