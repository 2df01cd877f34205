"""What the launchers of local server processes share (ZooKeeper, pulsar-lite): stopping,
killing, freezing and resuming one child process, and reading the end of its log."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_STOP_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 4000
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


# Resolved in the parent: loading a library in a forked child of a threaded process can hang.
_PRCTL = _load_prctl()


def terminate_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent goes away.

    Linux sends it when the *thread* that started the server ends, which is fine for tests
    (their servers are stopped anyway when the test ends); elsewhere it is a no-op.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


class LocalServerProcess:
    """One child server process; subclasses start it and set ``_process``."""

    #: For messages ("ZooKeeper", "pulsar-lite").
    server_name = "server"
    #: Raised when the process cannot be signalled or killed.
    error_type: type[Exception] = RuntimeError

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

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

    def _read_log_from(self, offset: int, max_bytes: int) -> str:
        with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as log_file:
            log_file.seek(offset)
            return log_file.read(max_bytes).decode("utf-8", errors="replace")
        return ""
