"""``STEWARD_TEST_BUSY_CORE=1`` (tests/support/busy_core.py): a second process spins for the
session and is killed at its end, with the CPU it used said."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.busy_core import ENV, BusyCore, wanted
from tests.support.worker_procs import wait_until


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks


def test_the_busy_process_spins_until_it_is_killed() -> None:
    busy = BusyCore()
    try:
        wait_until(lambda: _cpu_s(busy.process.pid) >= 0.2, 60, "the busy process to use CPU")
    finally:
        summary = busy.stop()
    assert busy.process.returncode == -9, busy.process.returncode
    assert f"{ENV}=1: busy process pid {busy.process.pid}" in summary
    assert "s of CPU" in summary and summary.endswith("killed"), summary
    assert busy.stop() == summary  # a second stop (pytest_unconfigure) changes nothing


@pytest.mark.parametrize(
    ("value", "expected"), [(None, False), ("", False), ("0", False), ("1", True)]
)
def test_the_switch_reads_1_or_0(value: str | None, expected: bool) -> None:
    assert wanted(value) is expected


def test_another_value_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match=r"must be 1 .* or 0, not 'yes'"):
        wanted("yes")
