"""``bench/bench_e2e.py`` (the side-by-side benchmark) runs Steward's modes through the public
client and prints its one table; a tiny run, real broker and workers, Steward alone (the
peers are not test dependencies). It checks the table, not any figure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from clients.client import StewardClient

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"[\d,]+"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_e2e.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
        env=env,
    )


def test_steward_modes_in_one_table() -> None:
    result = run_bench(
        "--systems",
        "steward",
        "--tasks",
        "60",
        "--warmup",
        "10",
        "--batch",
        "25",
        "--round-trips",
        "10",
        "--round-trip-warmup",
        "2",
        "--timeout-s",
        "60",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output
    assert "| system | mode | durable | submit tasks/s | end to end tasks/s " in result.stdout
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| steward \| (\S+) \|.*$", result.stdout, re.M)
    }
    assert set(rows) == {"per-call", "producer", "batched"}, result.stdout
    # per call: both rates and the round trip (p50 / p99); batched: both rates.
    assert re.match(
        rf"\| steward \| per-call \| yes \| {NUMBER} \| {NUMBER} \| [\d.]+ / [\d.]+ \|",
        rows["per-call"],
    )
    assert re.match(
        rf"\| steward \| batched \| yes \| {NUMBER} \| {NUMBER} \| - \|", rows["batched"]
    )
    if hasattr(StewardClient, "producer"):
        assert re.match(
            rf"\| steward \| producer \| yes \| {NUMBER} \| {NUMBER} \|", rows["producer"]
        )
    else:  # the producer mode says why it did not run, and the rest ran
        assert "skipped: StewardClient has no producer()" in rows["producer"]


def test_unknown_system_is_refused_before_anything_starts() -> None:
    result = run_bench("--systems", "steward,nosuch")
    assert result.returncode != 0
    assert "unknown systems ['nosuch']" in result.stderr
    assert "Traceback" not in result.stderr
