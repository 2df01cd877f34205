"""Task processes: warm per-tenant pools of processes that run tenant code.

Why processes (docs/SECURITY.md): the worker holds a credential and runs tasks of many
tenants; a task thread could read both. A task process serves one tenant only, ever, runs
under that tenant's uid (``clients/worker/task_identity.py``) with a scrubbed environment
and no descriptors but its pipes, is non-dumpable, and can be killed, which is what makes
cancel, deadlines and memory limits hard.

Why not ``multiprocessing``/``loky``/``billiard`` pools: none starts a child under another
uid with a chosen environment (they inherit the parent's), and each treats the death of
one child as the death of the pool (``BrokenProcessPool``), while here killing a task's
process is the normal way to cancel it. ``subprocess.Popen`` does the exec with
``user``/``group``/``extra_groups``/``env``/``umask``/``pass_fds``; the protocol is
``clients/worker/task_wire.py``. Measured cost per no-op task: docs/BENCHMARKS.md.

Pools. Processes are keyed by (tenant, memory limit) and reused most-recently-used first;
at most ``capacity`` (the worker's slots) live at once, an idle process of another key is
retired to make room. A process is retired after ``max_tasks`` tasks, when its resident
memory passes ``max_rss_mb``, after any cancel, crash or protocol error, and when idle for
``idle_s``. Every process is in its own session: retiring kills its whole process group.

Files (under the work root, ``0711``, the worker's): ``attempts/<uid>-<rand>`` (``0700``,
the task user's; one per process, every attempt's cwd and TMPDIR, found empty by each
attempt: see :meth:`TaskProcessPool.release`; removed with the process), ``homes/<uid>``
(``0700``, the task user's HOME) and ``code/<uid>/`` (``0750``, root:the task user's
group, files ``0640``): the verified artifacts that uid may import, copied from the
worker's cache so no tenant reads the cache itself.

Threads. One :class:`Dispatcher` thread reads every process's pipes and delivers outcomes
(no thread per process or per task); a cleaner thread removes what tasks leave behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from clients.worker import task_wire
from clients.worker.task_env import (
    PROJECT_ROOT,
    TaskProcessError,
    WorkArea,
    has_passwd_entry,
    nss_wrapper_library,
    scrubbed_env,
)
from clients.worker.task_identity import TaskIdentity

if TYPE_CHECKING:
    from clients.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

_READ_BYTES: Final = 64 * 1024
_START_TIMEOUT_S: Final = 60.0
_REAP_TIMEOUT_S: Final = 5.0


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"exited with signal {-returncode} ({name})"
    return f"exited with code {returncode}"


@dataclass
class Outcome:
    """How one Run ended: a Done, or the process's exit (``done`` None)."""

    done: task_wire.Done | None = None
    exit_description: str = ""
    output: bytes = b""
    killed: bool = False  # the worker killed it (cancel past its grace)


class _OutputTail:
    """The last ``limit`` bytes of a process's output for the current attempt."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self.dropped = 0
        self._lock = threading.Lock()  # the dispatcher adds while a follower reads

    def add(self, data: bytes) -> None:
        with self._lock:
            self._buffer += data
            if len(self._buffer) > 2 * self.limit:
                cut = len(self._buffer) - self.limit
                self.dropped += cut
                del self._buffer[:cut]

    def read_from(self, since: int) -> tuple[int, bytes]:
        """(offset, bytes) of what is held from offset ``since`` on (or from the first
        byte still held); offsets count from the start of the current attempt."""
        with self._lock:
            skip = max(0, since - self.dropped)
            return self.dropped + skip, bytes(self._buffer[skip:])

    def take(self) -> bytes:
        with self._lock:
            data = bytes(self._buffer[-self.limit :])
            dropped = self.dropped + len(self._buffer) - len(data)
            self._buffer.clear()
            self.dropped = 0
        if dropped:
            data = f"[... {dropped} earlier bytes of output dropped ...]\n".encode() + data
        return data


OutcomeCallback = Callable[[Outcome], None]


class TaskProcess:
    """One started task process. Its pipes are read by the pool's :class:`Dispatcher`."""

    def __init__(
        self,
        key: tuple[str, int],
        identity: TaskIdentity,
        popen: subprocess.Popen[bytes],
        control_fd: int,
        events_fd: int,
        *,
        workdir: str,
        max_frame_bytes: int,
        max_output_bytes: int,
    ) -> None:
        self.key = key
        self.workdir = workdir  # every attempt's cwd and TMPDIR, emptied in between
        self.identity = identity
        self.popen = popen
        self.pid = popen.pid
        self.tasks_run = 0
        self.last_used = time.monotonic()
        self._control_fd = control_fd
        self._control_lock = threading.Lock()  # a write never meets a closed (reused) fd
        self.events_fd = events_fd
        assert popen.stdout is not None
        self.output_fd = popen.stdout.fileno()
        self._decoder = task_wire.EventDecoder(max_frame_bytes)
        self._output = _OutputTail(max_output_bytes)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._on_outcome: OutcomeCallback | None = None  # the Run in progress, if any
        self._exited = threading.Event()
        self._killed = False

    # -- the worker's side (any thread) --

    def output_from(self, since: int) -> tuple[int, bytes]:
        """The current attempt's output held so far, from offset ``since`` on."""
        return self._output.read_from(since)

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s) and not self._exited.is_set()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    def start_run(self, run: task_wire.Run, on_outcome: OutcomeCallback) -> None:
        """Send one task; ``on_outcome`` is called once, on the dispatcher's thread, with
        its Done or the process's end. Never blocks on the task itself."""
        with self._lock:
            if self._on_outcome is not None:
                raise TaskProcessError(f"task process {self.pid} is already running a task")
            self._on_outcome = on_outcome
            self._killed = False
        self.tasks_run += 1
        try:
            self._write_control(run)
        except OSError as exc:
            # Its end (which the kill makes sure of) reaches on_outcome through the dispatcher.
            logger.warning("task process %d could not be given a task: %s", self.pid, exc)
            self.kill()

    def run(self, run: task_wire.Run) -> Outcome:
        """Send one task and block until its outcome (for callers with a thread to spare)."""
        finished = threading.Event()
        outcomes: list[Outcome] = []

        def on_outcome(outcome: Outcome) -> None:
            outcomes.append(outcome)
            finished.set()

        self.start_run(run, on_outcome)
        finished.wait()
        return outcomes[0]

    def cancel(self, reason: str, grace_s: float) -> None:
        """Cancel frame and SIGTERM now; SIGKILL to the group if no end within the grace."""
        with contextlib.suppress(OSError):
            self._write_control(task_wire.Cancel(reason=reason))
        self._signal(signal.SIGTERM)
        with self._lock:
            running = self._on_outcome
        timer = threading.Timer(grace_s, self._kill_if_running, args=(running,))
        timer.daemon = True
        timer.start()

    def _kill_if_running(self, cancelled: OutcomeCallback | None) -> None:
        with self._lock:
            if cancelled is None or self._on_outcome is not cancelled:
                return  # that task ended (and the process was retired) in time
            self._killed = True
        self.kill()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _write_control(self, message: task_wire.ToProcess) -> None:
        with self._control_lock:
            if self._control_fd < 0:
                raise BrokenPipeError("the task process's control pipe is closed")
            task_wire.write_frame(self._control_fd, message)

    def _close_control(self) -> None:
        with self._control_lock:
            fd, self._control_fd = self._control_fd, -1
        if fd >= 0:
            os.close(fd)

    def retire(self, *, wait: bool = True) -> None:
        """End the process (its whole group); ``wait``: until the dispatcher reaped it."""
        self._close_control()
        self.kill()
        if wait:
            self._exited.wait(_REAP_TIMEOUT_S)

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                pages = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            return 0.0
        return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)

    def _signal(self, sig: signal.Signals) -> None:
        if self._exited.is_set():
            return
        try:
            os.killpg(self.pid, sig)  # its own session: the task's children too
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - a group it left; the process itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    # -- the dispatcher's side (its thread only) --

    def on_output(self) -> bool:
        """Read the output pipe; False at its end."""
        try:
            data = os.read(self.output_fd, _READ_BYTES)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            self._output.add(data)
        return bool(data)

    def on_events(self) -> bool:
        """Read the events pipe and act on it; False once it ended or broke the protocol."""
        try:
            data = os.read(self.events_fd, _READ_BYTES)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:  # the process is ending
            self._drain_output()
            return False
        try:
            messages = self._decoder.feed(data)
        except task_wire.WireError as exc:
            logger.warning("task process %d broke the protocol (%s); killing it", self.pid, exc)
            self.kill()
            return False
        for message in messages:
            if isinstance(message, task_wire.Ready):
                self._ready.set()
                continue
            with self._lock:
                on_outcome, self._on_outcome = self._on_outcome, None
            if on_outcome is None:
                logger.warning("task process %d sent a Done with no task; killing it", self.pid)
                self.kill()
                return False
            self.last_used = time.monotonic()
            self._drain_output()
            _deliver(on_outcome, Outcome(done=message, output=self._output.take()))
        return True

    def _drain_output(self) -> None:
        # Everything the task wrote before its Done is already in the pipe.
        for _ in range(64):
            try:
                data = os.read(self.output_fd, _READ_BYTES)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            self._output.add(data)

    def on_exit(self) -> None:
        """The events pipe ended: reap the process and end the Run in progress, if any."""
        self.kill()  # a process that closed its events pipe is done for
        try:
            returncode = self.popen.wait(_REAP_TIMEOUT_S)
            description = describe_exit(returncode)
        except subprocess.TimeoutExpired:
            description = "stopped answering"
        os.close(self.events_fd)
        assert self.popen.stdout is not None
        self.popen.stdout.close()  # the output pipe (its file object owns the fd)
        self._close_control()
        with self._lock:
            killed = self._killed
            on_outcome, self._on_outcome = self._on_outcome, None
        self._ready.set()
        self._exited.set()
        if on_outcome is not None:
            outcome = Outcome(
                exit_description=description, output=self._output.take(), killed=killed
            )
            _deliver(on_outcome, outcome)


def _deliver(on_outcome: OutcomeCallback, outcome: Outcome) -> None:
    try:
        on_outcome(outcome)
    except Exception:  # the dispatcher serves every other task: log and go on
        logger.exception("handling a task process's outcome failed")


class Dispatcher:
    """One thread reading every task process's pipes (no thread per process or per task).

    Outcomes are delivered on this thread: their callbacks must not block.
    """

    def __init__(self, on_exit: Callable[[TaskProcess], None]) -> None:
        self._on_exit = on_exit
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._added: list[TaskProcess] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="steward-taskprocs", daemon=True)
        self._thread.start()

    def add(self, process: TaskProcess) -> None:
        with self._lock:
            self._added.append(process)
        self._wake()

    def close(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        self._thread.join(_REAP_TIMEOUT_S)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _loop(self) -> None:
        try:
            while True:
                for key, _ in self._selector.select():
                    if key.data is None:
                        if not self._take_added():
                            return
                    else:
                        self._on_ready(key.fileobj, key.data)  # type: ignore[arg-type]
        finally:
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _take_added(self) -> bool:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        with self._lock:
            added, self._added = self._added, []
            stopping = self._stopping
        for process in added:
            for fd in (process.events_fd, process.output_fd):
                os.set_blocking(fd, False)
                self._selector.register(fd, selectors.EVENT_READ, process)
        return not stopping

    def _on_ready(self, fd: int, process: TaskProcess) -> None:
        if not process.alive:  # ended earlier in this batch of events; its fds are closed
            return
        if fd == process.output_fd:
            if not process.on_output():
                self._selector.unregister(fd)
        elif not process.on_events():
            self._selector.unregister(fd)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(process.output_fd)
            process.on_exit()
            self._on_exit(process)


@dataclass
class PoolLimits:
    capacity: int
    idle_s: float = 60.0
    max_tasks: int = 1000
    max_rss_mb: float = 0.0  # 0: no limit
    max_output_bytes: int = 1024 * 1024
    max_frame_bytes: int = 8 * 1024 * 1024


class TaskProcessPool:
    """Warm task processes per (tenant, memory limit); see the module docstring."""

    def __init__(
        self,
        limits: PoolLimits,
        work: WorkArea,
        *,
        python: str = sys.executable,
        spark_env: dict[str, str] | None = None,
    ) -> None:
        self.limits = limits
        self.work = work
        self.python = python
        self.started = 0  # processes started, for tests and metrics
        self._idle: dict[tuple[str, int], list[TaskProcess]] = {}
        self._busy: set[TaskProcess] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._dispatcher = Dispatcher(self._on_exit)
        # Removes working directories (what tasks leave, those of ended processes) so
        # that neither the dispatcher nor the caller waits on a big tree.
        self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="steward-cleaner")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="steward-reaper", daemon=True)
        self._reaper.start()

    def idle_process(self, tenant: str, memory_limit_mb: int) -> TaskProcess | None:
        """A warm process of that key, now, or None (never starts one, never blocks)."""
        with self._lock:
            if self._closed:
                raise TaskProcessError("the worker is stopping")
            idle = self._idle.get((tenant, memory_limit_mb))
            while idle:
                process = idle.pop()  # most recently used: warmest caches
                if process.alive:
                    self._busy.add(process)
                    return process
        return None

    def acquire(self, tenant: str, memory_limit_mb: int, identity: TaskIdentity) -> TaskProcess:
        """A warm process of that key, or a new one (blocks while it starts)."""
        process = self.idle_process(tenant, memory_limit_mb)
        if process is not None:
            return process
        key = (tenant, memory_limit_mb)
        victim: TaskProcess | None = None
        with self._lock:
            if self._live() >= self.limits.capacity:
                victim = self._oldest_idle()
        if victim is not None:
            victim.retire()
        process = self._start(key, identity)
        with self._lock:
            self._busy.add(process)
        return process

    def release(self, process: TaskProcess, *, retire: bool, cleaned: bool = False) -> None:
        """Back to idle after a task (may run on the dispatcher's thread: never blocks)."""
        reason = ""
        if retire:
            reason = "after a cancel, a crash or running out of memory"
        elif not process.alive:
            reason = "exited"
        elif process.tasks_run >= self.limits.max_tasks:
            reason = f"after {process.tasks_run} tasks"
        elif self.limits.max_rss_mb and process.rss_mb() > self.limits.max_rss_mb:
            reason = f"resident memory over {self.limits.max_rss_mb:g} MB"
        else:
            clean = self.work.attempt_dir_clean(process.workdir, process.identity)
            if clean is False and not cleaned:  # leftovers: removed off this thread
                self._cleaner.submit(self._clean_then_release, process)
                return
            if not clean:
                reason = "its working directory was changed or could not be emptied"
        with self._lock:
            self._busy.discard(process)
            if not reason and not self._closed:
                self._idle.setdefault(process.key, []).append(process)
                return
        logger.debug("retiring task process %d (%s)", process.pid, reason or "stopping")
        process.retire(wait=False)  # may run on the dispatcher's thread, which reaps it

    def _clean_then_release(self, process: TaskProcess) -> None:
        emptied = self.work.empty_attempt_dir(process.workdir)
        self.release(process, retire=not emptied, cleaned=True)

    def _on_exit(self, process: TaskProcess) -> None:
        with self._lock:
            closed = self._closed
        if closed:  # the cleaner is shutting down: remove it here
            self.work.remove_attempt_dir(process.workdir)
        else:
            self._cleaner.submit(self.work.remove_attempt_dir, process.workdir)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            processes = [p for idle in self._idle.values() for p in idle] + list(self._busy)
            self._idle.clear()
        self._stop.set()
        for process in processes:
            process.retire()
        self._dispatcher.close()
        self._cleaner.shutdown(wait=True)

    def live(self) -> int:
        with self._lock:
            return self._live()

    def idle_pids(self, tenant: str | None = None) -> list[int]:
        with self._lock:
            return [
                p.pid
                for key, idle in self._idle.items()
                if tenant is None or key[0] == tenant
                for p in idle
            ]

    # -- internals --

    def _live(self) -> int:
        return len(self._busy) + sum(len(idle) for idle in self._idle.values())

    def _oldest_idle(self) -> TaskProcess | None:
        oldest: TaskProcess | None = None
        for idle in self._idle.values():
            for process in idle:
                if oldest is None or process.last_used < oldest.last_used:
                    oldest = process
        if oldest is not None:
            self._idle[oldest.key].remove(oldest)
        return oldest

    def _start(self, key: tuple[str, int], identity: TaskIdentity) -> TaskProcess:
        home = self.work.home(identity)
        workdir = self.work.make_attempt_dir(identity)
        control_r, control_w = os.pipe()
        events_r, events_w = os.pipe()
        args = [
            self.python,
            "-m",
            "clients.worker.task_host",
            "--control",
            str(control_r),
            "--events",
            str(events_w),
            "--max-frame-bytes",
            str(self.limits.max_frame_bytes),
            "--memory-limit-mb",
            str(key[1]),
            "--parent-pid",
            str(os.getpid()),
        ]
        try:
            popen = subprocess.Popen(
                args,
                env=scrubbed_env(home, identity),
                cwd=home,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(control_r, events_w),
                start_new_session=True,
                umask=0o077,
                user=identity.uid if identity.switch else None,
                group=identity.gid if identity.switch else None,
                extra_groups=[] if identity.switch else None,
            )
        except OSError as exc:
            for fd in (control_r, control_w, events_r, events_w):
                os.close(fd)
            self.work.remove_attempt_dir(workdir)
            raise TaskProcessError(
                f"could not start a task process as uid {identity.uid}: {exc}."
                f" The task user must be able to run {self.python} and read {PROJECT_ROOT}"
                " (see docs/SECURITY.md, 'Task processes')"
            ) from None
        os.close(control_r)
        os.close(events_w)
        process = TaskProcess(
            key,
            identity,
            popen,
            control_w,
            events_r,
            workdir=workdir,
            max_frame_bytes=self.limits.max_frame_bytes,
            max_output_bytes=self.limits.max_output_bytes,
        )
        self._dispatcher.add(process)
        if not process.wait_ready(_START_TIMEOUT_S):
            process.retire()
            tail = process._output.take().decode(errors="replace")[-2000:]
            raise TaskProcessError(
                f"a task process as uid {identity.uid} did not start: {tail.strip()}"
                f" (the task user must be able to run {self.python} and read {PROJECT_ROOT};"
                " see docs/SECURITY.md, 'Task processes')"
            )
        with self._lock:
            self.started += 1
        logger.debug("started task process %d for %s as uid %d", process.pid, key, identity.uid)
        return process

    def _reap_loop(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            stale: list[TaskProcess] = []
            with self._lock:
                for idle in self._idle.values():
                    for process in list(idle):
                        if not process.alive or now - process.last_used > self.limits.idle_s:
                            idle.remove(process)
                            stale.append(process)
            for process in stale:
                process.retire()


def check_task_processes(config: WorkerConfig) -> None:
    """Fail at start, with what to do, when task users could not run a task process.

    Starts one probe process as the identity a first tenant would get; ValueError (with
    the reason) when it cannot start or import the task host.
    """
    from clients.worker.runtime import task_identities

    identity = task_identities(config).for_tenant("steward-probe")
    work = WorkArea(config.work_dir)
    home = work.home(identity)
    try:
        probe = subprocess.run(
            [config.task_python, "-c", "import clients.worker.task_host"],
            env=scrubbed_env(home, identity),
            cwd=home,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_START_TIMEOUT_S,
            user=identity.uid if identity.switch else None,
            group=identity.gid if identity.switch else None,
            extra_groups=[] if identity.switch else None,
            check=False,
        )
        failure = (
            probe.stderr.decode(errors="replace").strip().splitlines()[-1:]
            if probe.returncode
            else []
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = [str(exc)]
    if identity.switch and not has_passwd_entry(identity.uid) and nss_wrapper_library() is None:
        print(
            f"steward worker: warning: uid {identity.uid} has no passwd entry and"
            " libnss-wrapper is not installed: tasks that start a JVM (Spark) will fail;"
            " apt-get install libnss-wrapper, or name users with --task-user",
            file=sys.stderr,
        )
    if failure:
        raise ValueError(
            f"task processes (uid {identity.uid}) cannot run {config.task_python} with"
            f" Steward from {PROJECT_ROOT}: {failure[0]}. Install Steward in a virtualenv"
            " made from a Python other users can read (e.g. /usr/bin/python3 -m venv"
            " /opt/steward), or name a user that can with --task-user USER"
            " (docs/SECURITY.md, 'Task processes')"
        )
