"""One task process seen from the worker: its pipes, the Runs it was sent, its output.

A :class:`TaskProcess` is started by ``clients/worker/task_processes/pool.py`` (the pools) and
speaks
``clients/worker/task_processes/pipe_protocol.py`` with ``clients/worker/task_processes/child.py``
(the process itself).
Runs are answered in the order sent; several may be outstanding (pipelining, see
:meth:`clients.worker.task_processes.pool.TaskProcessPool.pipeline_process`). The one
:class:`Dispatcher` thread of a pool reads every process's pipes and delivers outcomes
(no thread per process or per task). A process's output pipe is cut into attempts at the
marker the process writes after each Run (:class:`_OutputTail`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from clients.worker.task_identity import TaskIdentity
from clients.worker.task_processes import pipe_protocol

logger = logging.getLogger("clients.worker.task_processes")

_READ_BYTES: Final = 64 * 1024
REAP_TIMEOUT_S: Final = 5.0


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
    """How one Run ended: a Done, or the process's end (``done`` None)."""

    done: pipe_protocol.Done | None = None
    exit_description: str = ""
    output: bytes = b""
    killed: bool = False  # the worker killed it (cancel past its grace)
    # Never started: queued behind a task whose process ended (send it elsewhere), or
    # cancelled while queued (``skipped``).
    not_started: bool = False
    skipped: bool = False


class _OutputTail:
    """The output pipe of one process, cut into attempts at each ``marker``; of the
    attempt being written, the last ``limit`` bytes."""

    def __init__(self, limit: int, marker: bytes) -> None:
        self.limit = limit
        self.marker = marker
        self._buffer = bytearray()
        self.dropped = 0
        self._ended: deque[bytes] = deque()  # attempts whose marker was read, in order
        self._scanned = 0  # bytes of _buffer already searched for a marker
        self._lock = threading.Lock()  # the dispatcher adds while a follower reads

    def add(self, data: bytes) -> None:
        with self._lock:
            self._buffer += data
            while True:
                # A marker may arrive in pieces: look where one could still start.
                at = self._buffer.find(self.marker, max(0, self._scanned - len(self.marker)))
                if at < 0:
                    break
                self._ended.append(self._cut(self._buffer[:at], self.dropped))
                del self._buffer[: at + len(self.marker)]
                self.dropped = 0
                self._scanned = 0
            self._scanned = len(self._buffer)
            if len(self._buffer) > 2 * self.limit + len(self.marker):
                cut = len(self._buffer) - self.limit - len(self.marker)
                self.dropped += cut
                del self._buffer[:cut]
                self._scanned = len(self._buffer)

    def _cut(self, data: bytearray | bytes, dropped: int) -> bytes:
        kept = bytes(data[-self.limit :]) if len(data) > self.limit else bytes(data)
        dropped += len(data) - len(kept)
        if dropped:
            kept = f"[... {dropped} earlier bytes of output dropped ...]\n".encode() + kept
        return kept

    def read_from(self, since: int) -> tuple[int, bytes]:
        """(offset, bytes) of the attempt being written, from offset ``since`` on (or from
        the first byte still held)."""
        with self._lock:
            skip = max(0, since - self.dropped)
            return self.dropped + skip, bytes(self._buffer[skip:])

    def take_ended(self) -> bytes:
        """The output of the earliest attempt not taken yet (its marker read)."""
        with self._lock:
            if self._ended:
                return self._ended.popleft()
        return b""

    def take_all(self) -> bytes:
        """Everything held: the process ended (or wrote no marker)."""
        with self._lock:
            parts = list(self._ended)
            self._ended.clear()
            parts.append(self._cut(self._buffer, self.dropped))
            self._buffer.clear()
            self.dropped = 0
            self._scanned = 0
        return b"".join(parts)


OutcomeCallback = Callable[[Outcome], None]
TaskKey = tuple[int, int]

_held = threading.local()  # .processes: those with Runs held back on this thread


@contextlib.contextmanager
def batched_writes() -> Iterator[None]:
    """Hold back the Run frames sent on this thread and write each process's in one go at
    the end: one write (and one wake-up of the process) for a batch of tasks."""
    if getattr(_held, "processes", None) is not None:
        yield  # already batching further up this thread
        return
    processes: dict[TaskProcess, None] = {}
    _held.processes = processes
    try:
        yield
    finally:
        _held.processes = None
        for process in processes:
            process.flush()


@dataclass(eq=False)
class _Pending:
    """A Run sent to a process whose Done has not come back."""

    key: TaskKey
    type_name: str
    on_outcome: OutcomeCallback
    killed: bool = False
    # Where the Run's ctx.progress reports go (the worker-side TaskContext's recorder).
    on_progress: Callable[[float, str], None] | None = None
    # Its first ctx.spark asked for the tenant's Spark server
    # (clients/worker/spark/tenant_servers.py).
    on_spark_wanted: Callable[[], None] | None = None


class TaskProcess:
    """One started task process. Its pipes are read by the pool's :class:`Dispatcher`.

    Runs are answered in the order sent; several may be outstanding (pipelining, see
    :meth:`TaskProcessPool.pipeline_process`).
    """

    def __init__(
        self,
        key: tuple[str, int],
        identity: TaskIdentity,
        popen: subprocess.Popen[bytes],
        control_fd: int,
        events_fd: int,
        *,
        workdir: str,
        output_marker: bytes,
        max_frame_bytes: int,
        max_output_bytes: int,
    ) -> None:
        self.key = key
        self.identity = identity
        self.workdir = workdir  # every attempt's cwd and TMPDIR, emptied in between
        self.popen = popen
        self.pid = popen.pid
        self.tasks_run = 0
        self.last_used = time.monotonic()
        self.draining = False  # retire once the outstanding Runs are answered
        self._control_fd = control_fd
        self._control_lock = threading.Lock()  # a write never meets a closed (reused) fd
        self._outbox: list[bytes] = []  # Runs held back by batched_writes()
        self.events_fd = events_fd
        assert popen.stdout is not None
        self.output_fd = popen.stdout.fileno()
        self._decoder = pipe_protocol.EventDecoder(max_frame_bytes)
        self._output = _OutputTail(max_output_bytes, output_marker)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._pending: deque[_Pending] = deque()  # sent, not answered: the first is running
        self._skipped: set[TaskKey] = set()  # answered by the worker at cancel; Done ignored
        self._claims = 0  # Runs the pool promised a caller room for, not sent yet
        self._exited = threading.Event()

    # -- the worker's side (any thread) --

    def output_from(self, key: TaskKey, since: int) -> tuple[int, bytes] | None:
        """The running attempt's output held so far, from offset ``since`` on."""
        with self._lock:
            if not self._pending or self._pending[0].key != key:
                return None  # not running (yet): queued behind another
        return self._output.read_from(since)

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s) and not self._exited.is_set()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    def claim(self) -> None:
        """Reserve room for one Run (the pool, under its lock); start_run uses it."""
        with self._lock:
            self._claims += 1

    def unclaim(self) -> None:
        with self._lock:
            self._claims = max(0, self._claims - 1)

    def load(self) -> int:
        """Runs outstanding or claimed."""
        with self._lock:
            return len(self._pending) + self._claims

    def outstanding_types(self) -> list[str]:
        with self._lock:
            return [pending.type_name for pending in self._pending]

    def start_run(
        self,
        run: pipe_protocol.Run,
        on_outcome: OutcomeCallback,
        on_progress: Callable[[float, str], None] | None = None,
        on_spark_wanted: Callable[[], None] | None = None,
    ) -> None:
        """Send one task; ``on_outcome`` is called once with its Done or the process's end,
        on the dispatcher's thread (or the canceller's). Never blocks on the task itself."""
        with self._lock:
            self._claims = max(0, self._claims - 1)
            self._pending.append(
                _Pending(
                    (run.task_id, run.attempt),
                    run.type,
                    on_outcome,
                    on_progress=on_progress,
                    on_spark_wanted=on_spark_wanted,
                )
            )
        self.tasks_run += 1
        held: dict[TaskProcess, None] | None = getattr(_held, "processes", None)
        if held is not None:
            with self._control_lock:
                self._outbox.append(pipe_protocol.encode(run))
            held[self] = None
            return
        try:
            self._write_control(run)
        except OSError as exc:
            # Its end (which the kill makes sure of) reaches on_outcome through the dispatcher.
            logger.warning("task process %d could not be given a task: %s", self.pid, exc)
            self.kill()

    def flush(self) -> None:
        """Write the Runs held back by :func:`batched_writes`."""
        try:
            with self._control_lock:
                data, self._outbox = b"".join(self._outbox), []
                if data:
                    if self._control_fd < 0:
                        raise BrokenPipeError("the task process's control pipe is closed")
                    pipe_protocol.write_all(self._control_fd, data)
        except OSError as exc:
            logger.warning("task process %d could not be given tasks: %s", self.pid, exc)
            self.kill()

    def cancel(self, key: TaskKey, reason: str, grace_s: float) -> None:
        """Cancel one task: a Cancel frame, then SIGTERM (the process reads the frame and
        stops that task if it is the one running). A task still queued is answered now
        (skipped); the running one's process is killed if it has not ended after the grace.
        """
        with contextlib.suppress(OSError):
            self._write_control(pipe_protocol.Cancel(reason=reason, task_id=key[0], attempt=key[1]))
        with self._lock:
            found = next((p for p in self._pending if p.key == key), None)
            queued = found is not None and found is not self._pending[0]
            if queued:
                assert found is not None
                self._pending.remove(found)
                self._skipped.add(key)
        if found is None:
            return
        if queued:
            _deliver(found.on_outcome, Outcome(not_started=True, skipped=True))
            return
        self._signal(signal.SIGTERM)
        timer = threading.Timer(grace_s, self._kill_if_running, args=(found,))
        timer.daemon = True
        timer.start()

    def _kill_if_running(self, cancelled: _Pending) -> None:
        with self._lock:
            if cancelled not in self._pending:
                return  # that task ended in time
            cancelled.killed = True
        self.kill()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _write_control(self, message: pipe_protocol.ToProcess) -> None:
        with self._control_lock:
            if self._control_fd < 0:
                raise BrokenPipeError("the task process's control pipe is closed")
            # Held-back Runs first: frames reach the process in the order they were sent.
            data, self._outbox = b"".join(self._outbox), []
            pipe_protocol.write_all(self._control_fd, data + pipe_protocol.encode(message))

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
            self._exited.wait(REAP_TIMEOUT_S)

    def rss_mb(self) -> float:
        return self._statm_mb(1)

    def address_space_mb(self) -> float:
        """Its virtual memory (what ``RLIMIT_AS`` caps); 0 when it cannot be read."""
        return self._statm_mb(0)

    def _statm_mb(self, field: int) -> float:
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                pages = int(f.read().split()[field])
        except (OSError, ValueError, IndexError):
            return 0.0
        return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)

    def set_memory_limit(self, memory_limit_mb: int) -> bool:
        """Give a spare its memory limit (before its first Run); False if it is gone."""
        try:
            self._write_control(pipe_protocol.Limit(memory_limit_mb))
        except OSError as exc:
            logger.warning("task process %d could not be given its limit: %s", self.pid, exc)
            self.kill()
            return False
        return True

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
        data = _read_ready(self.output_fd)
        if data:
            self._output.add(data)
        return data != b""

    def on_events(self) -> bool:
        """Read the events pipe and act on it; False once it ended or broke the protocol."""
        data = _read_ready(self.events_fd)
        if data is None:
            return True
        if not data:  # the process is ending
            self._drain_output()
            return False
        try:
            messages = self._decoder.feed(data)
        except pipe_protocol.WireError as exc:
            logger.warning("task process %d broke the protocol (%s); killing it", self.pid, exc)
            self.kill()
            return False
        drained = False
        for message in messages:
            if isinstance(message, pipe_protocol.Ready):
                self._ready.set()
                continue
            if isinstance(message, pipe_protocol.Progress):
                self._on_progress(message)
                continue
            if isinstance(message, pipe_protocol.SparkWanted):
                self._on_spark_wanted(message)
                continue
            key = (message.task_id, message.attempt)
            with self._lock:
                if key in self._skipped:  # answered at its cancel
                    self._skipped.discard(key)
                    pending = None
                elif self._pending and self._pending[0].key == key:
                    pending = self._pending.popleft()
                else:
                    pending = _NO_TASK
            if pending is _NO_TASK:
                logger.warning("task process %d sent a Done for no task; killing it", self.pid)
                self.kill()
                return False
            if not drained:  # its output (and its marker) went into the pipe before the Done
                self._drain_output()
                drained = True
            output = self._output.take_ended()
            self.last_used = time.monotonic()
            if pending is not None:
                _deliver(pending.on_outcome, Outcome(done=message, output=output))
        return True

    def _on_progress(self, message: pipe_protocol.Progress) -> None:
        # Only the running Run reports (the first outstanding); a late one is moot.
        with self._lock:
            running = self._pending[0] if self._pending else None
        key = (message.task_id, message.attempt)
        if running is not None and running.key == key and running.on_progress is not None:
            running.on_progress(message.fraction, message.message)

    def _on_spark_wanted(self, message: pipe_protocol.SparkWanted) -> None:
        # Only the running Run asks, once (the callback is taken: a repeat is ignored).
        with self._lock:
            running = self._pending[0] if self._pending else None
            wanted = None
            if running is not None and running.key == (message.task_id, message.attempt):
                wanted, running.on_spark_wanted = running.on_spark_wanted, None
        if wanted is not None:
            wanted()

    def send_spark_granted(self, message: pipe_protocol.SparkGranted) -> None:
        """Answer a SparkWanted (any thread); a process that is gone needs no answer."""
        try:
            self._write_control(message)
        except OSError as exc:
            logger.debug("task process %d: Spark answer not sent: %s", self.pid, exc)

    def _drain_output(self) -> None:
        for _ in range(64):
            try:
                data = os.read(self.output_fd, _READ_BYTES)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            self._output.add(data)

    def on_exit(self) -> None:
        """The events pipe ended: reap the process; the running Run ends with it, those
        queued behind it never started."""
        self.kill()  # a process that closed its events pipe is done for
        try:
            returncode = self.popen.wait(REAP_TIMEOUT_S)
            description = describe_exit(returncode)
        except subprocess.TimeoutExpired:
            description = "stopped answering"
        os.close(self.events_fd)
        assert self.popen.stdout is not None
        self.popen.stdout.close()  # the output pipe (its file object owns the fd)
        self._close_control()
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        self._ready.set()
        self._exited.set()
        for index, item in enumerate(pending):
            if index == 0:
                outcome = Outcome(
                    exit_description=description,
                    output=self._output.take_all(),
                    killed=item.killed,
                )
            else:
                outcome = Outcome(exit_description=description, not_started=True)
            _deliver(item.on_outcome, outcome)


_NO_TASK: Final = _Pending((-1, -1), "", lambda outcome: None)


def _read_ready(fd: int) -> bytes | None:
    """What a non-blocking pipe holds: None if nothing yet, b"" at its end (or an error)."""
    try:
        return os.read(fd, _READ_BYTES)
    except BlockingIOError:
        return None
    except OSError:
        return b""


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
        self._thread.join(REAP_TIMEOUT_S)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _loop(self) -> None:
        try:
            while True:
                ready = self._selector.select()
                # Tasks that outcomes free slots for are sent together at the end.
                with batched_writes():
                    for key, _ in ready:
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
