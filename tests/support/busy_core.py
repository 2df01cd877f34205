"""``STEWARD_TEST_BUSY_CORE=1``: a second process keeps one core busy for the whole pytest
session (docs/TESTING.md, "A slower machine"), so the suite's bounds can be seen to hold on
a machine with a core less.

A pytest plugin (registered in tests/conftest.py): the process starts once, in the process
that runs the session (under xdist the controller, not each worker), before the header, which
names its pid; it is killed (SIGKILL to its pid) and reaped at the end, and the summary says
how much CPU it used. It cannot outlive the run: Linux kills it when pytest's main thread
goes, it stops once its parent is gone, and after :data:`MAX_S` in any case. Any value but
``1``, ``0`` or empty is a usage error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from clients.worker.sandbox import set_parent_death_signal

ENV = "STEWARD_TEST_BUSY_CORE"
#: The spinner stops by itself after this long (a bound if every other way failed).
MAX_S = 6 * 3600.0
_REAP_TIMEOUT_S = 10.0
_SPIN = f"""\
import os, time
parent = os.getppid()
end = time.monotonic() + {MAX_S}
while time.monotonic() < end and os.getppid() == parent:
    pass
"""


class BusyCore:
    """The spinning process: started at construction, ended by :meth:`stop`."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SPIN],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C aimed at the run is pytest's to handle
            preexec_fn=lambda: set_parent_death_signal(int(signal.SIGKILL)),
        )
        self.started = time.monotonic()
        self.summary: str | None = None

    def stop(self) -> str:
        """SIGKILL, reap (bounded), and say how long it ran and the CPU it used."""
        if self.summary is not None:
            return self.summary
        ran_s = time.monotonic() - self.started
        pid = self.process.pid
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        cpu_s = _reap_cpu_s(self.process)
        used = "" if cpu_s is None else f", used {cpu_s:.1f} s of CPU ({cpu_s / ran_s:.0%})"
        self.summary = f"{ENV}=1: busy process pid {pid} ran {ran_s:.1f} s{used}, killed"
        return self.summary


def _reap_cpu_s(process: subprocess.Popen[bytes]) -> float | None:
    """Reap the killed child with wait4 (its CPU time); None if Popen reaped it already."""
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    while True:
        try:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            raise RuntimeError(f"busy process pid {process.pid} survived SIGKILL")
        time.sleep(0.01)


def wanted(value: str | None) -> bool:
    """Whether ``STEWARD_TEST_BUSY_CORE``'s value asks for the busy core."""
    if value in (None, "", "0"):
        return False
    if value == "1":
        return True
    raise pytest.UsageError(f"{ENV} must be 1 (keep one core busy) or 0, not {value!r}")


_BUSY_CORE = pytest.StashKey[BusyCore]()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller runs it
        return
    if wanted(os.environ.get(ENV)):
        config.stash[_BUSY_CORE] = BusyCore()


def pytest_report_header(config: pytest.Config) -> str | None:
    busy = config.stash.get(_BUSY_CORE, None)
    if busy is None:
        return None
    return f"{ENV}=1: busy process pid {busy.process.pid} keeps one core busy"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    busy = terminalreporter.config.stash.get(_BUSY_CORE, None)
    if busy is not None:
        terminalreporter.write_line(busy.stop())


def pytest_unconfigure(config: pytest.Config) -> None:
    busy = config.stash.get(_BUSY_CORE, None)
    if busy is not None:
        busy.stop()
