"""The wall-clock shift the nemesis's clock jumps use (tests/jepsen/clock_shift.py)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.jepsen.clock_shift import install
from tests.support.worker_procs import wait_until


def test_the_wall_clock_jumps_both_ways_and_the_monotonic_clock_does_not(
    tmp_path: Path,
) -> None:
    control = tmp_path / "offset"
    control.write_text("0\n")
    undo = install(control)
    try:
        before = time.time()
        control.write_text("+100\n")
        wait_until(lambda: time.time() > before + 50, 5.0, "the jump forward", 0.01)
        start_wall, start_mono = time.time(), time.monotonic()
        control.write_text("-100\n")
        wait_until(lambda: time.time() < start_wall - 150, 5.0, "the jump back", 0.01)
        assert time.monotonic() >= start_mono
        assert abs(time.time_ns() / 1e9 - time.time()) < 1.0
        time.sleep(0.01)  # sleeping still works (libfaketime's monotonic exclusion broke it)
    finally:
        undo()
    assert abs(time.time() - before) < 50  # undone: the true time again
