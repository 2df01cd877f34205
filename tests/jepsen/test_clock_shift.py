"""The wall-clock shift the nemesis's clock jumps use (tests/jepsen/clock_shift.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.jepsen.clock_shift import install


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def test_the_wall_clock_jumps_both_ways_and_the_monotonic_clock_does_not(
    tmp_path: Path,
) -> None:
    control = tmp_path / "offset"
    control.write_text("0\n")
    undo = install(control)
    try:
        before = time.time()
        control.write_text("+100\n")
        wait_until(lambda: time.time() > before + 50)
        start_wall, start_mono = time.time(), time.monotonic()
        control.write_text("-100\n")
        wait_until(lambda: time.time() < start_wall - 150)
        assert time.monotonic() >= start_mono
        assert abs(time.time_ns() / 1e9 - time.time()) < 1.0
        time.sleep(0.01)  # sleeping still works (libfaketime's monotonic exclusion broke it)
    finally:
        undo()
    assert abs(time.time() - before) < 50  # undone: the true time again
