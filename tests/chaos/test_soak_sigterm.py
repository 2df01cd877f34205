"""``python -m tests.chaos.soak`` stopped with SIGTERM stops what it started (its brokers,
workers and ZooKeeper), as Ctrl-C does, and says so in one line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.worker_procs import wait_until

WAIT_S = 60.0


def processes_naming(text: str) -> list[int]:
    """Pids of the live processes whose command line holds ``text``, this one's excepted."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def test_sigterm_stops_the_soak_and_everything_it_started(tmp_path: Path) -> None:
    root = tmp_path / "soak"
    log = tmp_path / "soak.log"
    command = [sys.executable, "-m", "tests.chaos.soak", "--seed", "1", "--faults", "1"]
    with open(log, "wb") as out:
        soak = subprocess.Popen(
            [*command, "--keep", str(root)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        brokers = str(root / "cluster")

        def started() -> bool:
            assert soak.poll() is None, log.read_text(errors="replace")
            return any(pid != soak.pid for pid in processes_naming(brokers))

        wait_until(started, WAIT_S, "the soak's first broker", pause_s=0.1)
        soak.send_signal(signal.SIGTERM)
        code = soak.wait(timeout=WAIT_S)
        output = log.read_text(errors="replace")
        assert code == 130, output
        assert "chaos soak stopped (interrupted), seed 1" in output, output
        # ZooKeeper ends with its parent (stop_with_parent): a moment after the soak.
        wait_until(lambda: not processes_naming(str(root)), 10.0, "the soak's processes to end")
    finally:
        for pid in [soak.pid, *processes_naming(str(root))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            soak.wait(timeout=10)
