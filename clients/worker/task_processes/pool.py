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
``clients/worker/task_processes/pipe_protocol.py``. Measured cost per no-op task:
docs/BENCHMARKS.md.

Pools. Processes are keyed by (tenant, memory limit) and reused most-recently-used first;
at most ``capacity`` (the worker's slots) live at once, an idle process of another key is
retired to make room. A process is retired after ``max_tasks`` tasks, when its resident
memory passes ``max_rss_mb``, after any cancel, crash or protocol error, and when idle for
``idle_s``. Every process is in its own session: retiring kills its whole process group.

Spares (with per-tenant Spark servers: ``max_spares`` > 0). A tenant whose Spark was just
used keeps one spare process: started ahead of need, its Spark Connect client imported in
the background, no task run and no memory limit yet. A task of that tenant that finds no
idle process of its key takes the spare instead of starting one (the limit is sent in a
Limit frame before its Run and applied before any tenant code, as at a start; a spare
already over that limit is left for another task); the tenant's next use of Spark starts
a new spare. So a tenant's first PySpark task in a new process (another memory limit, a
second task at once, a process retired) pays a session and its query, not the ~0.8 s
import (docs/BENCHMARKS.md, issue 30). Spares take no slot: like the tenants' Spark
servers they are bounded apart, at most ``max_spares`` (the worker's ``--spark-max-servers``:
one per server it may run, ~140 MB each beside a server's heap), the least recently used
retired for a new tenant's, each ended after ``spare_idle_s`` without its tenant using
Spark (the server's own idle time). A spare taken by a task becomes a process of that key
and takes a slot: the oldest idle process is retired if the slots are then over.

Files (under the work root, ``0711``, the worker's): ``attempts/<uid>-<rand>`` (``0700``,
the task user's; one per process, every attempt's cwd and TMPDIR, found empty by each
attempt: see :meth:`TaskProcessPool.release`; removed with the process), ``homes/<uid>``
(``0700``, the task user's HOME) and ``code/<uid>/`` (``0750``, root:the task user's
group, files ``0640``): the verified artifacts that uid may import, copied from the
worker's cache so no tenant reads the cache itself.

Forks. ``Popen`` forks (it cannot vfork when it switches uid), so every ``pthread_atfork``
handler of the worker process runs in each child before its exec. grpc registers some,
and a worker loads grpc once it attaches to a Spark Connect session to interrupt it: about
one child in a hundred then died in them (SIGSEGV or SIGBUS) before its exec. The worker
turns them off before grpc is imported (:func:`disable_grpc_fork_handlers`).

Threads. One :class:`Dispatcher` thread (``clients/worker/task_processes/process_handle.py``, with
the
process's side of things) reads every process's pipes and delivers outcomes (no thread per
process or per task); a cleaner thread removes what tasks leave behind.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from clients.worker.spark.connect_server import tenant_uid_range
from clients.worker.task_env import (
    PROJECT_ROOT,
    TaskProcessError,
    WorkArea,
    empty_dir,
    jvm_user_name_problem,
    scrubbed_env,
)
from clients.worker.task_identity import TaskIdentities, TaskIdentity
from clients.worker.task_processes import pipe_protocol
from clients.worker.task_processes.process_handle import (
    Dispatcher,
    TaskProcess,
)

if TYPE_CHECKING:
    from clients.worker.config import WorkerConfig

logger = logging.getLogger("clients.worker.task_processes")

#: The memory limit in a spare's key: not known until a task takes it (module docstring).
SPARE_LIMIT: Final = -1


#: grpc reads it when it is first imported; "0": no fork handlers (grpc's own advice for a
#: process that only forks to exec).
GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"


def disable_grpc_fork_handlers() -> None:
    """Before grpc is imported in this process: its fork handlers would run in every task
    process this process forks (see the module's docstring, "Forks")."""
    os.environ[GRPC_FORK_SUPPORT_ENV] = "0"


_START_TIMEOUT_S: Final = 60.0


@dataclass
class PoolLimits:
    capacity: int
    idle_s: float = 60.0
    max_spares: int = 0  # 0: no spares (module docstring)
    spare_idle_s: float = 300.0
    max_tasks: int = 1000
    max_rss_mb: float = 0.0  # 0: no limit
    max_output_bytes: int = 1024 * 1024
    max_frame_bytes: int = 8 * 1024 * 1024
    # Pipelining: Runs of a tenant's task types that take under fast_task_us (on average)
    # are queued, up to pipeline_depth, on a process already running such tasks.
    pipeline_depth: int = 16
    fast_task_us: float = 1000.0


class TaskProcessPool:
    """Warm task processes per (tenant, memory limit); see the module docstring."""

    def __init__(
        self,
        limits: PoolLimits,
        work: WorkArea,
        *,
        python: str = sys.executable,
        preload_spark: bool = False,
    ) -> None:
        self.limits = limits
        self.work = work
        self.python = python
        # Task processes import the Spark Connect client in the background when they start.
        self.preload_spark = preload_spark
        self.started = 0  # processes started, for tests and metrics
        self._idle: dict[tuple[str, int], list[TaskProcess]] = {}
        self._busy: set[TaskProcess] = set()
        self._busy_by_key: dict[tuple[str, int], set[TaskProcess]] = {}
        # Spares by tenant, least recently used first, and the tenants whose spare starts.
        self._spares: OrderedDict[str, TaskProcess] = OrderedDict()
        self._spares_starting: set[str] = set()
        # Mean run time (microseconds, moving average) per (tenant, task type).
        self._run_us: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._dispatcher = Dispatcher(self._on_exit)
        # Removes working directories (what tasks leave, those of ended processes) so
        # that neither the dispatcher nor the caller waits on a big tree.
        self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="steward-cleaner")
        # Starts spares. A thread that lives as long as the pool: a task process dies with
        # the thread that started it (PR_SET_PDEATHSIG follows the parent thread).
        self._spare_starter = ThreadPoolExecutor(1, thread_name_prefix="steward-spare")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="steward-reaper", daemon=True)
        self._reaper.start()

    def idle_process(self, tenant: str, memory_limit_mb: int) -> TaskProcess | None:
        """A warm idle process of that key, else the tenant's spare (given that limit now),
        claimed for one Run, or None (never starts one, never blocks)."""
        with self._lock:
            if self._closed:
                raise TaskProcessError("the worker is stopping")
            idle = self._idle.get((tenant, memory_limit_mb))
            while idle:
                process = idle.pop()  # most recently used: warmest caches
                if process.alive:
                    self._mark_busy(process)
                    process.claim()
                    return process
            spare = self._take_spare(tenant, memory_limit_mb)
            over = spare is not None and self._live() > self.limits.capacity
            victim = self._oldest_idle() if over else None
        if victim is not None:
            victim.retire(wait=False)
        if spare is None or spare.set_memory_limit(memory_limit_mb):
            return spare
        self.unclaim(spare)  # gone: retired as it exited
        return None

    def keep_spare(self, tenant: str, identity: TaskIdentity) -> None:
        """``tenant`` just used its Spark (a grant, an attempt's end): its spare's idle time
        starts again; without one, one starts on a thread of its own, the least recently
        used spare retired if there are ``max_spares`` (module docstring). Never blocks."""
        if not self.limits.max_spares:
            return
        evicted: TaskProcess | None = None
        with self._lock:
            if self._closed or tenant in self._spares_starting:
                return
            spare = self._spares.get(tenant)
            if spare is not None:
                spare.last_used = time.monotonic()
                self._spares.move_to_end(tenant)
                return
            if self._spares and len(self._spares) + len(self._spares_starting) >= (
                self.limits.max_spares
            ):
                _, evicted = self._spares.popitem(last=False)
            self._spares_starting.add(tenant)
            # Under the lock: close() shuts the starter down only after it set _closed.
            self._spare_starter.submit(self._start_spare, tenant, identity)
        if evicted is not None:
            evicted.retire(wait=False)

    def _start_spare(self, tenant: str, identity: TaskIdentity) -> None:
        process: TaskProcess | None = None
        try:
            process = self._start((tenant, SPARE_LIMIT), identity)
        except Exception as exc:  # a spare is an optimisation: the task that needs one starts it
            logger.warning("no spare task process for tenant %s: %s", tenant, exc)
        with self._lock:
            self._spares_starting.discard(tenant)
            kept = process is not None and not self._closed and tenant not in self._spares
            if kept:
                assert process is not None
                process.last_used = time.monotonic()  # its idle time starts once it is up
                self._spares[tenant] = process
        if process is not None and not kept:
            process.retire()

    def spare_pid(self, tenant: str) -> int | None:
        """The pid of ``tenant``'s spare, if it has one."""
        with self._lock:
            spare = self._spares.get(tenant)
            return spare.pid if spare is not None else None

    def _take_spare(self, tenant: str, memory_limit_mb: int) -> TaskProcess | None:
        """(Under the lock.) The tenant's spare, keyed and claimed for that limit, unless it
        already uses more address space than the limit allows."""
        spare = self._spares.get(tenant)
        if spare is None or not spare.alive:
            return None
        if memory_limit_mb and spare.address_space_mb() > memory_limit_mb:
            return None  # a process of its own for this task
        del self._spares[tenant]
        spare.key = (tenant, memory_limit_mb)
        self._mark_busy(spare)
        spare.claim()
        return spare

    def pipeline_process(
        self, tenant: str, memory_limit_mb: int, type_name: str
    ) -> TaskProcess | None:
        """A busy process of that key to queue one more Run on, claimed, or None.

        Only for task types that take under ``fast_task_us`` on average, behind Runs that
        all do too, at most ``pipeline_depth`` deep: one wake-up of the process then runs
        several tasks (a no-op's round trip costs more than the task). Anything slower, or
        new, gets a process of its own, so a long task never holds up another.
        """
        fast_us = self.limits.fast_task_us
        with self._lock:
            if self._closed:
                raise TaskProcessError("the worker is stopping")
            if self._run_us.get((tenant, type_name), fast_us) >= fast_us:
                return None
            best: TaskProcess | None = None
            best_load = self.limits.pipeline_depth
            for process in self._busy_by_key.get((tenant, memory_limit_mb), ()):
                load = process.load()
                if load == 0 or load >= best_load or process.draining or not process.alive:
                    continue
                if all(
                    self._run_us.get((tenant, t), fast_us) < fast_us
                    for t in process.outstanding_types()
                ):
                    best, best_load = process, load
            if best is not None:
                best.claim()
            return best

    def mean_run_us(self, tenant: str, type_name: str) -> float | None:
        with self._lock:
            return self._run_us.get((tenant, type_name))

    def note_run_time(self, tenant: str, type_name: str, elapsed_us: int) -> None:
        """A task's run time, as its process measured it (it only steers pipelining of
        that tenant's own tasks)."""
        key = (tenant, type_name)
        with self._lock:
            mean = self._run_us.get(key)
            self._run_us[key] = elapsed_us if mean is None else 0.8 * mean + 0.2 * elapsed_us
            if len(self._run_us) > 10_000:  # bounded: forget the oldest type seen
                del self._run_us[next(iter(self._run_us))]

    def acquire(self, tenant: str, memory_limit_mb: int, identity: TaskIdentity) -> TaskProcess:
        """A warm process of that key, or a new one (blocks while it starts); claimed."""
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
            self._mark_busy(process)
            process.claim()
        return process

    def unclaim(self, process: TaskProcess) -> None:
        """A claimed process that was not given its Run after all."""
        process.unclaim()
        self.release(process, retire=False)

    def release(self, process: TaskProcess, *, retire: bool, cleaned: bool = False) -> None:
        """After each outcome (may run on the dispatcher's thread: never blocks): back to
        idle once nothing is outstanding, unless it must be retired."""
        with self._lock:
            if process.load():  # more Runs outstanding or claimed: not idle yet
                if retire:
                    process.draining = True
                return
            reason = ""
            if retire or process.draining:
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
                    process.claim()  # nobody queues work on it meanwhile
                    self._cleaner.submit(self._clean_then_release, process)
                    return
                if not clean:
                    reason = "its working directory was changed or could not be emptied"
            self._unmark_busy(process)
            if not reason and not self._closed:
                self._idle.setdefault(process.key, []).append(process)
                return
        logger.debug("retiring task process %d (%s)", process.pid, reason or "stopping")
        process.retire(wait=False)  # may run on the dispatcher's thread, which reaps it

    def _mark_busy(self, process: TaskProcess) -> None:
        self._busy.add(process)
        self._busy_by_key.setdefault(process.key, set()).add(process)

    def _unmark_busy(self, process: TaskProcess) -> None:
        self._busy.discard(process)
        busy = self._busy_by_key.get(process.key)
        if busy is not None:
            busy.discard(process)
            if not busy:
                del self._busy_by_key[process.key]

    def _clean_then_release(self, process: TaskProcess) -> None:
        emptied = empty_dir(process.workdir)
        process.unclaim()
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
            processes += self._spares.values()
            self._idle.clear()
            self._spares.clear()
        self._stop.set()
        for process in processes:
            process.retire()
        self._spare_starter.shutdown(wait=True)  # a spare that starts now is retired
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
        """Processes that take a slot (spares do not)."""
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
        """A new task process, ready. One that dies before it is ready is replaced once:
        a crash at start is seen rarely under load (a gRPC abort in the background import
        of the Spark client), and it should not fail the task it was started for."""
        for tries_left in (1, 0):
            process = self._spawn(key, identity)
            if process.wait_ready(_START_TIMEOUT_S):
                break
            crashed = not process.alive
            process.retire()
            tail = process._output.take_all().decode(errors="replace")[-2000:].strip()
            if crashed and tries_left:
                logger.warning("a task process died while starting; starting another: %s", tail)
                continue
            raise TaskProcessError(
                f"a task process as uid {identity.uid} did not start: {tail}"
                f" (the task user must be able to run {self.python} and read {PROJECT_ROOT};"
                " see docs/SECURITY.md, 'Task processes')"
            )
        with self._lock:
            self.started += 1
        logger.debug("started task process %d for %s as uid %d", process.pid, key, identity.uid)
        return process

    def _spawn(self, key: tuple[str, int], identity: TaskIdentity) -> TaskProcess:
        home = self.work.home(identity)
        workdir = self.work.make_attempt_dir(identity)
        marker_token = f"steward-attempt-end-{secrets.token_hex(8)}"
        control_r, control_w = os.pipe()
        events_r, events_w = os.pipe()
        args = [
            self.python,
            "-m",
            "clients.worker.task_processes.child",
            "--control",
            str(control_r),
            "--events",
            str(events_w),
            "--max-frame-bytes",
            str(self.limits.max_frame_bytes),
            *(["--spare"] if key[1] == SPARE_LIMIT else ["--memory-limit-mb", str(key[1])]),
            "--parent-pid",
            str(os.getpid()),
            "--output-marker",
            marker_token,
            *(["--preload-spark"] if self.preload_spark else []),
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
            output_marker=pipe_protocol.output_marker(marker_token),
            max_frame_bytes=self.limits.max_frame_bytes,
            max_output_bytes=self.limits.max_output_bytes,
        )
        self._dispatcher.add(process)
        return process

    def _reap_loop(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            stale: list[TaskProcess] = []
            with self._lock:
                for tenant, spare in list(self._spares.items()):
                    if not spare.alive or now - spare.last_used > self.limits.spare_idle_s:
                        del self._spares[tenant]
                        stale.append(spare)
                for idle in self._idle.values():
                    for process in list(idle):
                        if not process.alive or now - process.last_used > self.limits.idle_s:
                            idle.remove(process)
                            stale.append(process)
            for process in stale:
                process.retire()


class TaskProcessCheckError(ValueError):
    """Task processes could not start: the reason, and the directories on the way to the
    interpreter or Steward that other users cannot pass through (the usual cause as root:
    pyenv under a ``0700`` ``/root``). The worker and the demo each say what to do."""

    def __init__(self, uid: int, python: str, reason: str, closed_dirs: list[str]) -> None:
        self.uid = uid
        self.python = python
        self.reason = reason
        self.closed_dirs = closed_dirs
        closed = (
            f" ({', '.join(closed_dirs)} closed to other users: chmod o+x opens a directory"
            " for traversal only)"
            if closed_dirs
            else ""
        )
        super().__init__(
            f"task processes (uid {uid}) cannot run {python} with Steward from"
            f" {PROJECT_ROOT}: {reason}{closed}. Install Steward in a virtualenv made from a"
            " Python other users can read (e.g. /usr/bin/python3 -m venv /opt/steward), or"
            " name a user that can with --task-user USER (docs/SECURITY.md, 'Task processes')"
        )


def closed_to_others(*paths: str) -> list[str]:
    """The directories on the way to ``paths`` (as given, and with symlinks resolved) that
    other users cannot pass through (no o+x), in order, each once."""
    closed: list[str] = []
    for path in [p for given in paths for p in (os.path.abspath(given), os.path.realpath(given))]:
        directory = os.path.dirname(path)
        chain: list[str] = []
        while True:
            chain.append(directory)
            parent = os.path.dirname(directory)
            if parent == directory:
                break
            directory = parent
        for directory in reversed(chain):
            try:
                mode = os.stat(directory).st_mode
            except OSError:
                continue
            if not mode & 0o001 and directory not in closed:
                closed.append(directory)
    return closed


def task_identities(config: WorkerConfig) -> TaskIdentities:
    """Who runs each tenant's task processes (TaskUserError when the config is unusable)."""
    return TaskIdentities(
        task_user=config.task_user,
        tenant_users=config.tenant_users,
        uid_range=tenant_uid_range(config),
        allow_root=config.allow_root_tasks,
    )


def check_task_processes(config: WorkerConfig) -> list[str]:
    """Fail at start, with what to do, when task users could not run a task process.

    Starts one probe process as the identity a first tenant would get;
    TaskProcessCheckError (a ValueError, with the reason) when it cannot start or import the
    task host. Returns warnings: what would fail later, for some tasks only.
    """
    identity = task_identities(config).for_tenant("steward-probe")
    work = WorkArea(config.work_dir)
    home = work.home(identity)
    try:
        probe = subprocess.run(
            [config.task_python, "-c", "import clients.worker.task_processes.child"],
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
    warnings: list[str] = []
    jvm_problem = jvm_user_name_problem(identity.uid) if identity.switch else None
    if jvm_problem is not None:
        warnings.append(
            f"{jvm_problem}: tasks that start a JVM (Spark) will fail; apt-get install"
            " libnss-wrapper, or name users with --task-user"
        )
    if failure:
        closed = (
            closed_to_others(config.task_python, str(PROJECT_ROOT / "clients"))
            if identity.switch
            else []
        )
        raise TaskProcessCheckError(identity.uid, config.task_python, failure[0], closed)
    return warnings
