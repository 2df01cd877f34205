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
