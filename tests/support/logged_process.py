"""What the test launchers of brokers and workers share: a subprocess whose output goes to a
log file, its bounded kill, the log's tail, and polling a broker's ``/healthz``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx


def open_log(path: Path, header: str = "") -> IO[bytes]:
    """The log file, opened for appending (its folder made), with ``header`` written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "ab")  # noqa: SIM115 - the caller closes it
    if header:
        log.write(header.encode())
        log.flush()
    return log


def spawn_logged(
    command: list[str], log: IO[bytes], env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``command`` with stdout and stderr into ``log``, in a session of its own (a ^C
    of the test run does not hit it first)."""
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def kill9(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGKILL ``proc`` (by pid) if it still runs, and reap it (bounded)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout_s)


def log_tail(path: Path, max_bytes: int) -> str:
    try:
        with open(path, "rb") as log_file:
            log_file.seek(0, os.SEEK_END)
            size = log_file.tell()
            log_file.seek(max(0, size - max_bytes))
            return log_file.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"


def log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def wait_healthy(
    url: str,
    proc: Callable[[], subprocess.Popen[bytes] | None],
    *,
    name: str,
    verify: Any,
    timeout_s: float,
    probe_timeout_s: float,
    tail: Callable[[], str],
    error: Callable[[str], Exception],
) -> dict[str, Any]:
    """Poll ``url``'s ``/healthz`` until it answers 200 (a follower answers 200 too) and
    return its body; raise ``error`` if the process (``proc()``) exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(base_url=url, timeout=probe_timeout_s, verify=verify) as client:
        while True:
            process = proc()
            if process is None or process.poll() is not None:
                code = process.returncode if process is not None else None
                raise error(f"{name} exited with code {code} before it was healthy\n{tail()}")
            try:
                response = client.get("/healthz")
                if response.status_code == 200:
                    body: dict[str, Any] = response.json()
                    return body
                last = f"HTTP {response.status_code}: {response.text}"
            except httpx.TransportError as exc:
                last = repr(exc)
            if time.monotonic() >= deadline:
                raise error(f"{name} not healthy within {timeout_s} s ({last})\n{tail()}")
            time.sleep(0.05)


class LoggedProcess:
    """A subprocess with its output in a log file: its pid, whether it runs, the log (open
    while the process may write to it, its tail and its text), a kill by pid and a bounded
    wait for its exit. The broker and worker launchers of the tests build on it."""

    tail_bytes = 8000  # what log_tail() shows by default

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name  # as messages name it: "broker", "broker b1", "worker w1"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file: IO[bytes] | None = None
        self.log_offset = 0  # where the latest start's output begins in the log

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn_logged(self, command: list[str], env: dict[str, str], header: str = "") -> None:
        """Start ``command`` with its output appended to the log, after ``header``."""
        self.close_log()
        self.log_file = open_log(self.log_path)
        self.log_offset = self.log_file.tell()
        if header:
            self.log_file.write(header.encode())
            self.log_file.flush()
        self.proc = spawn_logged(command, self.log_file, env)

    def kill9(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the process (by pid) if it runs, reap it (bounded), close the log."""
        if self.proc is not None:
            kill9(self.proc, timeout_s)
        self.close_log()

    def wait_for_exit(
        self, timeout_s: float, error: Callable[[str], Exception] = AssertionError, why: str = ""
    ) -> int:
        """The exit code; after ``timeout_s`` a SIGKILL and ``error`` with the log's tail."""
        assert self.proc is not None, f"{self.name} was never started"
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise error(
                f"{self.name} did not exit within {timeout_s} s{why}\n{self.log_tail()}"
            ) from None
        self.close_log()
        return code

    def close_log(self) -> None:
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    def log_tail(self, max_bytes: int | None = None) -> str:
        return log_tail(self.log_path, self.tail_bytes if max_bytes is None else max_bytes)

    def log_text(self) -> str:
        return log_text(self.log_path)
