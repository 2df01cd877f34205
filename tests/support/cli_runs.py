"""The ``steward`` CLI run as a newcomer runs it, for tests that check what it says: a fresh
environment (no ``STEWARD_URL``/``STEWARD_TOKEN`` of the caller's), bounded, no traceback."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from tests.support.procs import steward_command

CLI_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str
    elapsed_s: float


def steward(*args: str, env: dict[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S) -> Run:
    clean = {k: v for k, v in os.environ.items() if k not in ("STEWARD_URL", "STEWARD_TOKEN")}
    started = time.monotonic()
    done = subprocess.run(
        [*steward_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**clean, **(env or {})},
        stdin=subprocess.DEVNULL,
        check=False,
    )
    run = Run(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
    assert "Traceback" not in run.out + run.err, run
    return run


def one_line_error(run: Run, code: int, *words: str) -> str:
    """The run failed with ``code`` and one ``steward`` line holding every word."""
    assert run.code == code, run
    lines = [line for line in run.err.splitlines() if line.strip()]
    message = lines[-1]
    assert message.startswith("steward"), run
    for word in words:
        assert word in message, (word, run)
    return message
