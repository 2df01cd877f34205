"""One short Jepsen run (docs/TESTING.md, "Partitions"): the file ledger, a handful of
network and process faults, and the checker passes. ``STEWARD_JEPSEN_SEED`` picks the
seed, ``STEWARD_JEPSEN_FAULTS`` the number of faults."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_short_run_passes_the_checker() -> None:
    seed = os.environ.get("STEWARD_JEPSEN_SEED", "11")
    faults = os.environ.get("STEWARD_JEPSEN_FAULTS", "8")
    directory = Path(tempfile.mkdtemp(prefix="steward-jepsen-"))
    command = [sys.executable, "-m", "tests.jepsen", "--seed", seed, "--faults", faults]
    result = subprocess.run(
        [*command, "--dir", str(directory), "--timeout-s", "300"],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20_000:]
    assert "checker passed" in output
    partitions = [line for line in output.splitlines() if line.startswith("nemesis")]
    assert len([p for p in partitions if " heal " not in p]) == int(faults), output[-5000:]
    shutil.rmtree(directory)  # kept when the run failed: its logs and history.jsonl
