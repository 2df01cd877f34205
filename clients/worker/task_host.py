"""A task process: runs one tenant's tasks, one at a time, for the worker that started it.

Started by ``clients/worker/task_procs.py`` with ``python -m clients.worker.task_host``,
already under the tenant's uid, with a scrubbed environment and no descriptors but its
pipes (see docs/SECURITY.md). Before any tenant code it makes itself non-dumpable, forbids
new privileges and applies its memory limit (``RLIMIT_AS``, hard, so task code cannot
raise it). Then it speaks ``clients/worker/task_wire.py``: Ready, then a Done for each Run.

Its stdout and stderr (one pipe, read by the worker) are the task's captured output;
``ctx.logger`` writes there too. A reader thread takes Cancel frames while a task runs; the
worker sends SIGTERM with each Cancel, which raises :class:`TaskCancelled` in the task's
(main) thread so even a busy loop stops; the worker kills the process if it does not.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import resource
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from broker.protocol import AssignedTask
from clients.worker import sandbox, task_wire
from clients.worker.spark_connect import (
    CLASSIC_FLAG_HINT,
    SPARK_MODE_ENV,
    ConnectEndpoint,
    connect_session,
    preload_spark_client,
)
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
        self.runs: queue.Queue[task_wire.Run | None] = queue.Queue()
        self.current: TaskContext | None = None
        self.lock = threading.Lock()
        self.artifacts: dict[str, Any] = {}
        self.sigterm_raised = False

    # -- the control reader (a thread) --

    def read_control(self) -> None:
        try:
            while True:
                message = task_wire.read_to_process(self.control_fd, self.max_frame_bytes)
                if message is None:
                    break
                if isinstance(message, task_wire.Run):
                    self.runs.put(message)
                else:
                    self.cancel(message.reason)
        except (OSError, task_wire.WireError) as exc:
            print(f"steward task process: control pipe: {exc}", file=sys.stderr, flush=True)
        # The worker is gone or done with this process: a task must not run on unreported.
        os._exit(0)

    def cancel(self, reason: str) -> None:
        with self.lock:
            ctx = self.current
        if ctx is None:
            return
        ctx._cancel(reason)
        if ctx.uses_spark:
            try:
                ctx._cancel_spark()
            except Exception as exc:  # the process is ended anyway if the task goes on
                print(f"steward: cancelling Spark jobs failed: {exc}", file=sys.stderr)

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        with self.lock:
            ctx = self.current
            first = not self.sigterm_raised
            self.sigterm_raised = True
        if ctx is None:
            os._exit(0)  # between tasks: nothing to clean up
        ctx._cancel(ctx.cancel_reason or "cancelled")
        if first:  # once: a task that catches it gets the grace, then SIGKILL
            raise TaskCancelled(ctx.cancel_reason or "cancelled")

    # -- the main thread --

    def serve(self) -> None:
        task_wire.write_frame(self.events_fd, task_wire.Ready(pid=os.getpid()))
        while True:
            run = self.runs.get()
            if run is None:
                return
            done = self.run(run)
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
            **spark_access(run),
        )
        with self.lock:
            self.current = ctx
            self.sigterm_raised = False
        try:
            os.chdir(run.workdir)
            tempfile.tempdir = run.workdir
            os.environ["TMPDIR"] = run.workdir
            result = call_task(ctx, run.params, lambda: self.resolve(run), run.max_result_bytes)
            return task_wire.Done(ok=True, result=result, spawn=ctx.spawned)
        except BaseException as exc:  # every failure of task code (even SystemExit) is a report
            error = error_text(exc)
            if run.spark_mode == "connect" and "JVM_ATTRIBUTE_NOT_SUPPORTED" in error:
                # ctx.spark.sparkContext (RDDs) on a Connect session: say what to use.
                error = f"{SPARK_CONTEXT_HINT}\n\n{error}"
            return task_wire.Done(ok=False, error=error, out_of_memory=isinstance(exc, MemoryError))
        finally:
            with self.lock:
                self.current = None
            ctx._leave_job_group()
            ctx._release_spark()

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


SPARK_CONTEXT_HINT = (
    "ctx.spark is a Spark Connect session (DataFrames and SQL): for sparkContext or RDDs use"
    " ctx.classic_spark, on a worker started with --allow-classic-spark"
)


def spark_access(run: task_wire.Run) -> dict[str, Any]:
    """How ``ctx.spark`` and ``ctx.classic_spark`` behave for this Run (TaskContext kwargs)."""
    classic_refused = (
        None if run.allow_classic_spark else f"classic Spark is off: {CLASSIC_FLAG_HINT}"
    )
    if run.spark_mode == "off":
        off = "Spark is off on this worker (steward worker --spark off)"
        return {"spark_unavailable": off, "classic_unavailable": off}
    if run.spark_mode != "connect":
        return {"classic_unavailable": classic_refused}
    if run.spark_error:
        return {
            "spark_unavailable": f"Spark is not available: {run.spark_error}",
            "classic_unavailable": classic_refused,
        }
    endpoint = ConnectEndpoint(
        run.spark_connect_port, run.spark_connect_token, run.spark_connect_uid
    )
    return {
        "connect_factory": lambda: connect_session(
            endpoint, run.spark_session_id, run.spark_wait_s
        ),
        "classic_unavailable": classic_refused,
    }


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
    threading.Thread(target=host.read_control, name="steward-control", daemon=True).start()
    if os.environ.get(SPARK_MODE_ENV) == "connect":
        # The Spark Connect client takes ~0.5 s to import: not on the first Spark task.
        threading.Thread(target=preload_spark_client, name="steward-preload", daemon=True).start()
    host.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
