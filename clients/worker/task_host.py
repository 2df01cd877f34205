"""A task process: runs one tenant's tasks, one at a time, for the worker that started it.

Started by ``clients/worker/task_procs.py`` with ``python -m clients.worker.task_host``,
already under the tenant's uid, with a scrubbed environment and no descriptors but its
pipes (see docs/SECURITY.md). Before any tenant code it makes itself non-dumpable, forbids
new privileges and applies its memory limit (``RLIMIT_AS``, hard, so task code cannot
raise it). Then it speaks ``clients/worker/task_wire.py``: Ready, then a Done for each Run.

Its stdout and stderr (one pipe, read by the worker) are the task's captured output;
``ctx.logger`` writes there too. Frames are read and tasks run on the main thread (no
hand-off between threads per task). A cancel is SIGTERM (the worker also sends a Cancel
frame, read after the task): it raises :class:`TaskCancelled` in the task's thread so even
a busy loop stops; the worker kills the process if it does not. The process exits when its
control pipe closes between tasks, and with the worker (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from broker.workers.protocol import AssignedTask
from clients.worker import sandbox, task_wire
from clients.worker.task_api import (
    BUILTIN_TASKS,
    TaskCancelled,
    TaskContext,
    TaskFn,
    call_task,
    error_text,
    shared_spark,
)


class _Host:
    def __init__(self, control_fd: int, events_fd: int, max_frame_bytes: int) -> None:
        self.control_fd = control_fd
        self.events_fd = events_fd
        self.max_frame_bytes = max_frame_bytes
        self.current: TaskContext | None = None
        self.artifacts: dict[str, Any] = {}
        self.sigterm_raised = False

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread, between bytecodes of the task (or in its blocking call).
        ctx = self.current
        if ctx is None:
            os._exit(0)  # between tasks: nothing to clean up
        ctx._cancel(ctx.cancel_reason or "cancelled")
        if ctx.uses_spark:  # its jobs run in the JVM: cancel them too, off this thread
            threading.Thread(target=_cancel_spark, args=(ctx,), daemon=True).start()
        if not self.sigterm_raised:  # once: a task that catches it gets the grace, then SIGKILL
            self.sigterm_raised = True
            raise TaskCancelled(ctx.cancel_reason or "cancelled")

    def serve(self) -> None:
        """Ready, then one Done per Run, read and run on this (the main) thread."""
        task_wire.write_frame(self.events_fd, task_wire.Ready(pid=os.getpid()))
        while True:
            try:
                message = task_wire.read_to_process(self.control_fd, self.max_frame_bytes)
            except (OSError, task_wire.WireError) as exc:
                print(f"steward task process: control pipe: {exc}", file=sys.stderr, flush=True)
                return
            if message is None:  # the worker is done with this process
                return
            if isinstance(message, task_wire.Cancel):
                continue  # for a task that has ended already (a running one gets SIGTERM)
            done = self.run(message)
            sys.stdout.flush()
            sys.stderr.flush()
            task_wire.write_frame(self.events_fd, done)

    def run(self, run: task_wire.Run) -> task_wire.Done:
        task = AssignedTask(
            task_id=run.task_id,
            attempt=run.attempt,
            type=run.type,
            tenant=run.tenant,
            params=run.params,
            code=run.code,
            deadline_ms=run.deadline_ms,
            resources=run.resources,
        )
        ctx = TaskContext(
            task,
            spark_factory=lambda: shared_spark(run.spark_master, run.spark_conf),
            max_result_bytes=run.max_result_bytes,
        )
        self.sigterm_raised = False
        self.current = ctx
        try:
            os.chdir(run.workdir)
            tempfile.tempdir = run.workdir
            os.environ["TMPDIR"] = run.workdir
            result = call_task(ctx, run.params, lambda: self.resolve(run), run.max_result_bytes)
            return task_wire.Done(ok=True, result=result, spawn=ctx.spawned)
        except BaseException as exc:  # every failure of task code (even SystemExit) is a report
            return task_wire.Done(
                ok=False, error=error_text(exc), out_of_memory=isinstance(exc, MemoryError)
            )
        finally:
            self.current = None
            ctx._leave_job_group()

    def resolve(self, run: task_wire.Run) -> TaskFn:
        fn = BUILTIN_TASKS.get(run.type)
        if fn is not None:
            return fn
        if run.code is None or run.code_path is None:
            raise LookupError(f"task type {run.type!r} needs a code artifact (none given)")
        from clients.worker.artifacts import load_verified

        loaded = self.artifacts.get(run.code)
        if loaded is None:
            loaded = load_verified(run.code, Path(run.code_path))
            self.artifacts[run.code] = loaded
        resolved: TaskFn = loaded.resolve(run.type)
        return resolved


def _cancel_spark(ctx: TaskContext) -> None:
    try:
        ctx._cancel_spark()
    except Exception as exc:  # the process is ended anyway if the task goes on
        print(f"steward: cancelling Spark jobs failed: {exc}", file=sys.stderr)


def _limit_memory(limit_mb: int) -> None:
    if limit_mb > 0:
        limit = limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steward-task-process")
    parser.add_argument("--control", type=int, required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--max-frame-bytes", type=int, required=True)
    parser.add_argument("--memory-limit-mb", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    sandbox.die_with_parent(args.parent_pid)
    sandbox.make_non_dumpable()
    sandbox.forbid_new_privileges()
    _limit_memory(args.memory_limit_mb)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    host = _Host(args.control, args.events, args.max_frame_bytes)
    signal.signal(signal.SIGTERM, host.on_sigterm)
    host.serve()
    # The worker is gone or done with this process; exit without waiting for threads a
    # task may have left behind.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
