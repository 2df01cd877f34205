"""What the launchers of local server processes share (ZooKeeper, pulsar-lite): stopping,
killing, freezing and resuming one child process, and reading the end of its log."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from clients.worker.sandbox import set_parent_death_signal

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
DEFAULT_STOP_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 4000


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class _PortTakenError(Exception):
    """The server could not bind its port."""


def terminate_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent goes away.

    Linux sends it when the *thread* that started the server ends, which is fine for tests
    (their servers are stopped anyway when the test ends); elsewhere it is a no-op.
    """
    set_parent_death_signal(int(signal.SIGTERM))


class LocalServerProcess:
    """One child server process on 127.0.0.1 with its files in ``directory``.

    Subclasses give its command, config, readiness check and log path; the port is chosen
    once (a free one unless given) and kept across restarts, so clients reconnect to the
    same address. ``stop_with_parent=True`` (Linux, for tests) makes the kernel send the
    server SIGTERM when the thread that started it ends.
    """

    #: For messages ("ZooKeeper", "pulsar-lite").
    server_name = "server"
    #: Raised when the process cannot be started, signalled or killed.
    error_type: type[Exception] = RuntimeError
    #: Log text that means the port was taken during start.
    port_taken_markers: tuple[str, ...] = ("Address already in use",)
    #: How much of the log one start may write that is read to find why it failed.
    start_log_bytes = LOG_TAIL_BYTES * 4
    #: Pause between readiness checks during start.
    ready_poll_s = 0.1
    #: Default bound of start().
    start_timeout_s = 30.0

    def __init__(
        self, directory: str | os.PathLike[str], *, port: int | None, stop_with_parent: bool
    ) -> None:
        self._directory = Path(directory).resolve()
        self._fixed_port = port is not None
        self._port = port if port is not None else free_port()
        self._stop_with_parent = stop_with_parent
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._started_once = False
        self._launch_log_offset = 0

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def data_dir(self) -> Path:
        return self._directory / "data"

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def address(self) -> str:
        """How clients name the server (for messages)."""
        return f"{HOST}:{self._port}"

    def is_running(self) -> bool:
        """Whether the process exists (it may be paused, or not ready yet)."""
        return self._process is not None and self._process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The status of a process that ended by itself (None: running, or stopped or
        killed through this object, or never started)."""
        return self._process.poll() if self._process is not None else None

    # -- what subclasses provide ---------------------------------------------------------------

    def _write_config(self) -> None:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> None:
        """Launch the server and wait until it is ready.

        If the port was picked automatically and another process took it before the server
        bound it, the first start retries once on a new port. Raises ``error_type`` with the
        tail of the server's log when it exits or is not ready within ``timeout_s``.
        """
        if self.is_running():
            raise self.error_type(f"{self.server_name} is already running (pid {self.pid})")
        deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
        try:
            self._launch_and_wait(deadline)
        except _PortTakenError:
            if self._fixed_port or self._started_once:
                raise self.error_type(
                    f"port {self._port} is taken; log tail:\n{self.log_tail()}"
                ) from None
            self._port = free_port()
            logger.warning("%s port race lost, retrying on port %d", self.server_name, self._port)
            self._launch_and_wait(deadline)
        self._started_once = True

    def _launch_and_wait(self, deadline: float) -> None:
        self._write_config()
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._launch_log_offset = log_offset
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                self._command(),
                cwd=self._directory,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Own process group: a Ctrl-C aimed at the test run does not hit the server
                # before the fixture's stop() does.
                start_new_session=True,
                preexec_fn=terminate_with_parent if self._stop_with_parent else None,
            )
        self._paused = False
        logger.info("%s starting on %s (pid %d)", self.server_name, self.address, self._process.pid)
        while True:
            if self._process.poll() is not None:
                self._process = None
                new_output = self._read_log_from(log_offset, self.start_log_bytes)
                if any(marker in new_output for marker in self.port_taken_markers):
                    raise _PortTakenError
                raise self.error_type(
                    f"{self.server_name} exited during start; log tail:\n"
                    + new_output[-LOG_TAIL_BYTES:]
                )
            if self._ready():
                return
            if time.monotonic() >= deadline:
                self._kill_process()
                raise self.error_type(
                    f"{self.server_name} on {self.address} not ready in time; log tail:\n"
                    + self.log_tail()
                )
            time.sleep(self.ready_poll_s)

    def restart(self, timeout_s: float | None = None) -> None:
        """Stop cleanly and start again on the same port with the same data."""
        self.stop()
        self.start(timeout_s)

    def __enter__(self) -> Self:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. No-op when not running."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            if self._paused:
                # A stopped process only acts on SIGTERM once it runs again.
                process.send_signal(signal.SIGCONT)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) ignored SIGTERM, killing it", self.server_name, process.pid
                )
                self._kill_process()
        self._process = None
        self._paused = False

    def _kill_process(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            try:
                process.wait(timeout=DEFAULT_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise self.error_type(
                    f"{self.server_name} pid {process.pid} survived SIGKILL"
                ) from None
        self._process = None
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: the server freezes; clients see no answers (their TCP connections stay)."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def _signal(self, signum: signal.Signals) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            raise self.error_type(f"{self.server_name} is not running")
        process.send_signal(signum)

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The end of the server's log (for error messages)."""
        size = self.log_path.stat().st_size if self.log_path.exists() else 0
        return self._read_log_from(max(0, size - max_bytes), max_bytes)

    def log_since_launch(self, max_bytes: int) -> str:
        """What the latest start wrote to the log so far (its first ``max_bytes``)."""
        return self._read_log_from(self._launch_log_offset, max_bytes)

    def _read_log_from(self, offset: int, max_bytes: int) -> str:
        with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as log_file:
            log_file.seek(offset)
            return log_file.read(max_bytes).decode("utf-8", errors="replace")
        return ""
