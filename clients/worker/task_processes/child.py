"""A task process: runs one tenant's tasks, one at a time, for the worker that started it.

Started by ``clients/worker/task_processes/pool.py`` with ``python -m
clients.worker.task_processes.child``,
already under the tenant's uid, with a scrubbed environment and no descriptors but its
pipes (see docs/SECURITY.md). Before any tenant code it makes itself non-dumpable, forbids
new privileges and applies its memory limit (``RLIMIT_AS``, hard, so task code cannot
raise it): at start, or, for a spare (``--spare``: started ahead of need, its limit not
known yet; ``clients/worker/task_processes/pool.py``), from the Limit frame that must come before
its first Run. Then it speaks ``clients/worker/task_processes/pipe_protocol.py``: Ready, then a
Done for each Run.

Its stdout and stderr (one pipe, read by the worker) are the task's captured output;
``ctx.logger`` writes there too; after each task the process writes ``--output-marker``
there, which tells the worker where one attempt's output ends. Frames are read and tasks
run on the main thread, in the order sent (no hand-off between threads per task). A cancel
is a Cancel frame then SIGTERM: the handler reads the frame and, when it names the running
task, raises :class:`TaskCancelled` in it, so even a busy loop stops (the worker kills the
process if it does not); a cancelled task not started yet is skipped. The process exits
when its control pipe closes between tasks, and with the worker (``PR_SET_PDEATHSIG``).

``ctx.progress`` only records the report; a sender thread writes the latest one as a
Progress frame at most every ``_PROGRESS_INTERVAL_S`` (never the task's own thread: a
SIGTERM raising in it mid-write would cut a frame short).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import select
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

import msgspec

from clients.worker import sandbox
from clients.worker.spark.connect_server import (
    CLASSIC_FLAG_HINT,
    ConnectEndpoint,
    connect_session,
    preload_spark_client,
)
from clients.worker.spark.remote import remote_session
from clients.worker.task_api import (
    BUILTIN_TASKS,
    TaskCancelled,
    TaskContext,
    TaskFn,
    call_task,
    error_text,
    shared_spark,
)
from clients.worker.task_env import empty_dir
from clients.worker.task_processes import pipe_protocol
from wire.worker_protocol import AssignedTask

_READ_BYTES: Final = 64 * 1024
# A task process writes at most this many Progress frames a second (the worker sends the
# broker at most one a second per attempt: more would only be dropped there).
_PROGRESS_INTERVAL_S: Final = 0.2


class _ProgressSender:
    """Writes the running task's latest ctx.progress on the events pipe, off its thread."""

    def __init__(self, write: Callable[[pipe_protocol.FromProcess], None]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._pending: pipe_protocol.Progress | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def sink(self, task_id: int, attempt: int) -> Callable[[float, str], None]:
        """The ctx.progress hook of one Run."""

        def report(fraction: float, message: str) -> None:
            with self._lock:
                self._pending = pipe_protocol.Progress(task_id, attempt, fraction, message)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="steward-progress", daemon=True
                    )
                    self._thread.start()
            self._wake.set()

        return report

    def drop(self) -> None:
        """The Run ended: a report it left unsent is moot."""
        with self._lock:
            self._pending = None

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                frame, self._pending = self._pending, None
            if frame is not None:
                try:
                    self._write(frame)
                except OSError:
                    return  # the worker is gone; the main thread finds out too
            time.sleep(_PROGRESS_INTERVAL_S)


class _Host:
    def __init__(
        self,
        control_fd: int,
        events_fd: int,
        max_frame_bytes: int,
        output_marker: bytes,
        *,
        limit_pending: bool = False,
    ) -> None:
        self.control_fd = control_fd
        self.events_fd = events_fd
        self.output_marker = output_marker
        self.decoder = pipe_protocol.ControlDecoder(max_frame_bytes)
        self.runs: deque[pipe_protocol.Run] = deque()
        self.cancelled: set[tuple[int, int]] = set()  # (task_id, attempt) to skip or stop
        # The worker's answers to SparkWanted (per-tenant Spark servers), by (task_id, attempt).
        self.spark_granted: dict[tuple[int, int], pipe_protocol.SparkGranted] = {}
        self.control_ended = False
        self.limit_pending = limit_pending  # a spare: no Run before its Limit
        self.current: TaskContext | None = None
        self.current_key: tuple[int, int] | None = None
        self.artifacts: dict[str, Any] = {}
        self.sigterm_raised = False
        self._events_lock = threading.Lock()  # the progress sender writes there too
        self.progress = _ProgressSender(self.write_event)
        os.set_blocking(control_fd, False)

    def write_event(self, message: pipe_protocol.FromProcess) -> None:
        with self._events_lock:
            pipe_protocol.write_frame(self.events_fd, message)

    def take_control(self) -> None:
        """Take every frame the worker sent so far; never blocks."""
        while not self.control_ended:
            try:
                data = os.read(self.control_fd, _READ_BYTES)
            except BlockingIOError:
                return
            if not data:
                self.control_ended = True
                return
            for message in self.decoder.feed(data):
                if isinstance(message, pipe_protocol.Run):
                    if self.limit_pending:
                        raise pipe_protocol.WireError("a Run came before the spare's Limit")
                    self.runs.append(message)
                elif isinstance(message, pipe_protocol.SparkGranted):
                    self.spark_granted[(message.task_id, message.attempt)] = message
                elif isinstance(message, pipe_protocol.Limit):
                    if not self.limit_pending:
                        raise pipe_protocol.WireError("a Limit came to a process that has one")
                    _limit_memory(message.memory_limit_mb)
                    self.limit_pending = False
                else:
                    self.cancelled.add((message.task_id, message.attempt))

    def tenant_spark(self, run: pipe_protocol.Run) -> Any:
        """``ctx.spark`` on the tenant's own server: ask the worker for it (it starts the
        server on first use) and wait, bounded, for its answer; then connect as usual."""
        key = (run.task_id, run.attempt)
        self.write_event(pipe_protocol.SparkWanted(task_id=run.task_id, attempt=run.attempt))
        deadline = time.monotonic() + run.spark_wait_s
        while key not in self.spark_granted:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"Spark is not available: the worker did not start this tenant's Spark"
                    f" Connect server within {run.spark_wait_s:.0f} s (see the worker's log)"
                )
            if self.control_ended:
                raise RuntimeError("Spark is not available: the worker closed the task's pipe")
            select.select([self.control_fd], [], [], min(left, 1.0))
            # Not re-entered by on_sigterm (which reads control too) mid-frame: a SIGTERM
            # waits for the unblock, then raises TaskCancelled here as anywhere in the task.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                self.take_control()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        granted = self.spark_granted.pop(key)
        if granted.error:
            raise RuntimeError(f"Spark is not available: {granted.error}")
        endpoint = ConnectEndpoint(granted.port, granted.token, granted.uid)
        return connect_session(endpoint, run.spark_session_id, run.spark_wait_s, run.spark_pool)

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread, between bytecodes of the task (or in its blocking call).
        ctx = self.current
        if ctx is None:
            return  # between tasks: the main loop reads the Cancel that came first
        try:
            self.take_control()  # the worker wrote the Cancel before it signalled
        except (OSError, pipe_protocol.WireError):
            os._exit(3)
        if self.current_key not in self.cancelled:
            return  # a Cancel for a task still queued here: it will be skipped
        ctx._cancel(ctx.cancel_reason or "cancelled")
        if ctx.uses_spark:  # its jobs run in the JVM: cancel them too, off this thread
            threading.Thread(target=_cancel_spark, args=(ctx,), daemon=True).start()
        if not self.sigterm_raised:  # once: a task that catches it gets the grace, then SIGKILL
            self.sigterm_raised = True
            raise TaskCancelled(ctx.cancel_reason or "cancelled")

    def serve(self) -> None:
        """Ready, then a Done for each Run in order, all on this (the main) thread."""
        self.write_event(pipe_protocol.Ready(pid=os.getpid()))
        while True:
            try:
                self.take_control()
            except (OSError, pipe_protocol.WireError) as exc:
                print(f"steward task process: control pipe: {exc}", file=sys.stderr, flush=True)
                return
            if not self.runs:
                if self.control_ended:  # the worker is done with this process
                    return
                select.select([self.control_fd], [], [])
                continue
            run = self.runs.popleft()
            key = (run.task_id, run.attempt)
            if key in self.cancelled:
                done = pipe_protocol.Done(
                    ok=False,
                    error="cancelled before it started",
                    task_id=run.task_id,
                    attempt=run.attempt,
                    skipped=True,
                )
            else:
                done = self.run(run)
            self.cancelled.discard(key)
            self.spark_granted.clear()  # a late answer for a Run that ended: moot
            if self.cancelled:  # only Cancels for runs still queued stay
                self.cancelled &= {(r.task_id, r.attempt) for r in self.runs}
            empty_dir(run.workdir)  # the worker checks again when the process goes idle
            sys.stdout.flush()
            sys.stderr.flush()
            pipe_protocol.write_all(1, self.output_marker)
            self.write_event(done)

    def run(self, run: pipe_protocol.Run) -> pipe_protocol.Done:
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
            **spark_access(run, self.tenant_spark),
        )
        ctx._progress_sink = self.progress.sink(run.task_id, run.attempt)
        started = 0.0
        try:
            self.sigterm_raised = False
            self.current_key = (run.task_id, run.attempt)
            self.current = ctx  # from here on a SIGTERM may raise TaskCancelled
            os.chdir(run.workdir)
            tempfile.tempdir = run.workdir
            os.environ["TMPDIR"] = run.workdir
            fn = self.resolve(run)  # the first run imports its code: not the task's time
            started = time.perf_counter()
            result = call_task(ctx, run.params, lambda: fn, run.max_result_bytes)
            done = pipe_protocol.Done(ok=True, result=result, spawn=ctx.spawned)
        except BaseException as exc:  # every failure of task code (even SystemExit) is a report
            error = error_text(exc)
            if run.spark_mode == "connect":
                error = _with_spark_hint(error, ctx.uses_spark)
            done = pipe_protocol.Done(
                ok=False, error=error, out_of_memory=isinstance(exc, MemoryError)
            )
        finally:
            self.current = None
            self.current_key = None
            self.progress.drop()
            ctx._leave_job_group()
            ctx._release_spark()
        elapsed_us = int((time.perf_counter() - started) * 1e6) if started else 0
        return msgspec.structs.replace(
            done, task_id=run.task_id, attempt=run.attempt, elapsed_us=elapsed_us
        )

    def resolve(self, run: pipe_protocol.Run) -> TaskFn:
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


SPARK_CONTEXT_HINT = (
    "ctx.spark is a Spark Connect session (DataFrames and SQL): for sparkContext or RDDs use"
    " ctx.classic_spark, on a worker started with --allow-classic-spark"
)

SPARK_SESSION_FIRST_HINT = (
    "this task used pyspark before its Spark session existed (made on first use of"
    " ctx.spark): touch ctx.spark first, e.g. `spark = ctx.spark` (docs/TASKS.md)"
)
_NO_SESSION_YET = re.compile(r"NO_ACTIVE_OR_DEFAULT_SESSION|SESSION_OR_CONTEXT_NOT_EXISTS")


def _with_spark_hint(error: str, session_made: bool) -> str:
    """A Connect task's error, with what to do first when it is a known Spark misuse."""
    if "JVM_ATTRIBUTE_NOT_SUPPORTED" in error:
        # ctx.spark.sparkContext (RDDs) on a Connect session: say what to use.
        return f"{SPARK_CONTEXT_HINT}\n\n{error}"
    if not session_made and _NO_SESSION_YET.search(error):
        # e.g. sf.udf(f, "long") parses its type on the session, made lazily by ctx.spark.
        return f"{SPARK_SESSION_FIRST_HINT}\n\n{error}"
    return error


def spark_access(
    run: pipe_protocol.Run, tenant_spark: Callable[[pipe_protocol.Run], Any] | None = None
) -> dict[str, Any]:
    """How ``ctx.spark`` and ``ctx.classic_spark`` behave for this Run (TaskContext kwargs);
    ``tenant_spark`` asks the worker for the tenant's own server (``spark_on_request``)."""
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
    if run.spark_remote:
        return {
            "connect_factory": lambda: remote_session(
                run.spark_remote, run.spark_session_id, run.spark_pool, run.spark_wait_s
            ),
            "classic_unavailable": classic_refused,
        }
    if run.spark_on_request:
        if tenant_spark is None:
            return {
                "spark_unavailable": "Spark is not available: no way to ask the worker for it",
                "classic_unavailable": classic_refused,
            }
        return {
            "connect_factory": lambda: tenant_spark(run),
            "classic_unavailable": classic_refused,
        }
    endpoint = ConnectEndpoint(
        run.spark_connect_port, run.spark_connect_token, run.spark_connect_uid
    )
    return {
        "connect_factory": lambda: connect_session(
            endpoint, run.spark_session_id, run.spark_wait_s, run.spark_pool
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
    parser.add_argument("--output-marker", required=True)
    parser.add_argument("--preload-spark", action="store_true")
    parser.add_argument("--spare", action="store_true")
    args = parser.parse_args(argv)
    sandbox.die_with_parent(args.parent_pid)
    sandbox.make_non_dumpable()
    sandbox.forbid_new_privileges()
    if not args.spare:  # a spare's comes in a Limit frame, before its first Run
        _limit_memory(args.memory_limit_mb)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    host = _Host(
        args.control,
        args.events,
        args.max_frame_bytes,
        pipe_protocol.output_marker(args.output_marker),
        limit_pending=args.spare,
    )
    signal.signal(signal.SIGTERM, host.on_sigterm)
    if args.preload_spark:
        # The Spark Connect client takes ~0.5 s to import: not on the first Spark task.
        threading.Thread(target=preload_spark_client, name="steward-preload", daemon=True).start()
    host.serve()
    # The worker is gone or done with this process; exit without waiting for threads a
    # task may have left behind.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
