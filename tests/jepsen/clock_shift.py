"""``python -m tests.jepsen.clock_shift CONTROL MODULE [ARGS...]``: run ``MODULE`` as
``python -m MODULE ARGS...`` with its wall clock shifted by the offset in seconds written in
the file ``CONTROL`` (read every :data:`POLL_S`; the nemesis jumps a broker's clock by
rewriting it, docs/TESTING.md "Partitions").

Only the wall clock moves (``time.time``, ``time.time_ns``: what
``broker/replication/clock.py`` stamps entries, ledger ages, snapshots and timers with, and
what kazoo and logging read); the monotonic clock does not, as on a host whose NTP steps
the wall clock. Not libfaketime: Debian's 0.9.10 with ``FAKETIME_DONT_FAKE_MONOTONIC``
makes every ``time.sleep`` of Python 3.11 fail with EINVAL (libfaketime issue 426), and
without it the monotonic clock jumps too, which no real host does.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.05


def read_offset(control: Path, default: float) -> float:
    try:
        return float(control.read_text().strip() or 0.0)
    except (OSError, ValueError):  # being replaced, or not written yet
        return default


def install(control: Path) -> Callable[[], None]:
    """Shift ``time.time`` and ``time.time_ns`` by the file's offset from now on; returns
    the undo. A daemon thread re-reads the file every :data:`POLL_S`."""
    real_time, real_time_ns = time.time, time.time_ns
    offset = [read_offset(control, 0.0)]
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            offset[0] = read_offset(control, offset[0])

    threading.Thread(target=poll, name="clock-shift", daemon=True).start()
    time.time = lambda: real_time() + offset[0]
    time.time_ns = lambda: real_time_ns() + int(offset[0] * 1e9)

    def undo() -> None:
        stop.set()
        time.time, time.time_ns = real_time, real_time_ns

    return undo


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m tests.jepsen.clock_shift CONTROL MODULE [ARGS...]")
    control, module = Path(sys.argv[1]), sys.argv[2]
    install(control)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
